"""The cycle ban (kvsim.decoding.cycle_ban): which tokens it bans, and greedy decoding under it."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from kvsim.decoding.cycle_ban import CycleBan, CycleBanConfig, cycle_starts
from kvsim.minivox.evaluate import EvalOptions, decode_clip, generation_options, main
from tests.test_minivox_model import _tiny_model, _tiny_tokenizer
from tests.test_read_window import _audio


def _starts(tokens: list[int], max_period: int = 16, repeats: int = 3) -> set[int]:
    return cycle_starts(torch.tensor(tokens), CycleBanConfig(max_period, repeats))


def test_the_token_starting_one_copy_too_many_is_banned():
    assert _starts([5, 1, 2, 1, 2, 1, 2]) == {1}  # three copies of (1, 2): a fourth is banned
    assert _starts([5, 1, 2, 1, 2]) == set()  # two copies are allowed
    assert _starts([7, 7, 7]) == {7}
    assert _starts([7, 7, 7], repeats=4) == set()
    assert _starts([1, 2, 1, 2], repeats=2) == {1}
    assert _starts([2, 1, 2, 1, 2, 1, 2, 3]) == set()  # the cycle must end the tail


def test_every_period_up_to_the_longest_is_looked_for():
    tail = [4, 9, 9, 9] * 3  # (9) three times at the end, and (4, 9, 9, 9) three times
    assert _starts(tail) == {9, 4}
    assert _starts(tail, max_period=3) == {9}
    assert _starts([1, 2, 3, 4] * 3, max_period=4) == {1}
    assert _starts([1, 2, 3, 4] * 3, max_period=3) == set()
    assert _starts([1, 2, 3, 4] * 2 + [1, 2, 3]) == set()  # not three whole copies


def test_the_prompt_is_not_read_and_banned_tokens_get_minus_infinity():
    ids = torch.tensor([[3, 3, 3, 8, 3, 3, 3], [3, 3, 3, 8, 1, 2, 5]])
    scores = torch.zeros(2, 10)
    ban = CycleBan(CycleBanConfig(4, 3), prompt_length=4)
    out = ban(ids, scores.clone())
    assert torch.isneginf(out[0, 3]) and torch.isfinite(out[0]).sum() == 9
    assert torch.isfinite(out[1]).all()  # the prompt's 3 3 3 is not a generated cycle
    assert ban.fired == 1
    later = CycleBan(CycleBanConfig(4, 3), prompt_length=5)
    assert torch.isfinite(later(ids, scores.clone())).all() and later.fired == 0


@pytest.fixture(scope="module")
def tiny():
    from kvsim.minivox.processing import MinivoxProcessor

    tok = _tiny_tokenizer()
    return _tiny_model(len(tok)), MinivoxProcessor(tok, "<empty_output>")


def _longest_run(tokens: list[int], period: int) -> int:
    """Most copies in a row of any cycle of ``period`` tokens in ``tokens``."""
    best = 1
    for start in range(len(tokens)):
        copies = 1
        while tokens[start: start + period] == tokens[start + copies * period: start + (copies + 1) * period]:
            copies += 1
        best = max(best, copies)
    return best


def _generated(model, proc, audio, **kwargs) -> list[int]:
    inp = proc(audio=audio)
    res = model.generate(**inp, max_new_tokens=60, do_sample=False, **kwargs)
    return res[0, inp["input_ids"].shape[1]:].tolist()


def test_greedy_decoding_under_the_ban_never_writes_a_fourth_copy(tiny):
    model, proc = tiny
    audio = _audio(2)
    plain = _generated(model, proc, audio)
    assert max(_longest_run(plain, p) for p in range(1, 5)) > 3  # the untrained model loops
    cfg = CycleBanConfig(max_period=4, repeats=3)
    n_in = proc(audio=audio)["input_ids"].shape[1]
    banned = _generated(model, proc, audio, logits_processor=LogitsProcessorList([CycleBan(cfg, n_in)]))
    assert max(_longest_run(banned, p) for p in range(1, 5)) <= 3
    first_ban = next(i for i in range(len(plain)) if cycle_starts(torch.tensor(plain[:i]), cfg))
    assert banned[:first_ban] == plain[:first_ban]  # greedy until the ban first fires


def test_decode_clip_counts_the_steps_the_ban_fired(tiny):
    model, proc = tiny
    audio = _audio(2)
    opts = EvalOptions(ban_cycles=CycleBanConfig(4, 3))
    dec = decode_clip(model, proc, audio, ref_words=30, opts=opts, options=generation_options())
    assert dec.cycle_bans > 0
    plain = decode_clip(model, proc, audio, ref_words=30, opts=EvalOptions(), options=generation_options())
    assert plain.cycle_bans == 0 and plain.text != dec.text


@pytest.mark.parametrize("spec, message", [
    ("16", "MAX_PERIOD,REPEATS"), ("16,x", "invalid literal"), ("0,3", "period"), ("16,1", "repeats"),
])
def test_cycle_ban_spec_errors_name_the_option(spec, message):
    with pytest.raises(ValueError, match=message):
        CycleBanConfig.parse(spec)


def test_cycle_ban_spec_round_trips_and_the_cli_rejects_a_bad_one():
    cfg = CycleBanConfig.parse("16,3")
    assert cfg == CycleBanConfig() and cfg.spec() == "16,3"
    with pytest.raises(SystemExit, match="--ban-cycles '16': MAX_PERIOD,REPEATS"):
        main(["--ban-cycles", "16"])
