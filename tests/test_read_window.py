"""The read window (kvsim.decoding.read_window): position, mask, attention calls, generation.

Mutation testing (mutmut 3.8.1 on kvsim/decoding/, with this file, tests/test_cycle_ban.py and
tests/test_live_decoding_options.py: ``bash scripts/mutation_test.sh --target decoding``;
2026-12-05): 389 mutants, all killed or timed out but two
equivalent ones (``torch.full`` of a bool without ``dtype=torch.bool`` is bool anyway) and
``register_read_window`` registering ``None`` for the context variable, which fails
test_a_window_wider_than_the_audio_decodes_exactly_as_plain_greedy in a fresh process (mutmut's
forked runs inherit the registration made before the mutant was switched on).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvsim.decode_attention import masked_decode_attention
from kvsim.decoding.read_window import (
    ReadPosition,
    ReadWindow,
    ReadWindowConfig,
    reading_with,
    register_read_window,
)
from kvsim.minivox.evaluate import EvalOptions, decode_clip, generation_options, main
from kvsim.minivox.modeling import AUDIO_TOKENS_PER_SECOND as RATE
from tests.test_minivox_model import _tiny_model, _tiny_tokenizer


def test_position_moves_forward_only_and_is_pushed_after_a_stall():
    r = ReadPosition(n_audio=10, stall_tokens=3)
    r.advance(4)
    r.advance(2)  # behind: stays, one stalled token
    r.advance(4)  # the same place: two
    assert (r.position, r.still, r.forced, r.floor) == (4, 2, 0, 0)
    r.advance(3)  # the third stalled token: one forced step, and the audio before it leaves
    assert (r.position, r.still, r.forced, r.floor) == (5, 0, 1, 5)
    r.advance(7)
    assert (r.position, r.still) == (7, 0)
    assert r.path == [4, 4, 4, 5, 7]
    assert not r.past_end


def test_position_past_the_audio_only_by_a_forced_step():
    r = ReadPosition(n_audio=4, stall_tokens=1)
    r.advance(3)  # the last audio token: still reading
    assert not r.past_end
    r.advance(3)
    assert r.position == 4 and r.past_end


def test_window_mask_covers_the_audio_around_the_position_and_never_the_text():
    cfg = ReadWindowConfig(behind_s=1.0, ahead_s=2.0, stall_tokens=4, layers=(1,))
    behind, ahead = round(1.0 * RATE), round(2.0 * RATE)
    w = ReadWindow(cfg, audio_start=3, n_audio=100, audio_tokens_per_s=RATE)
    assert w.window() == (0, ahead + 1)
    w.reading.position = 50
    assert w.window() == (50 - behind, 50 + ahead + 1)
    w.reading.floor = 45
    assert w.window() == (45, 50 + ahead + 1)
    keep = w.keep(n_kv_heads=2, n_keys=3 + 100 + 7)
    expected = torch.ones(110, dtype=torch.bool)
    expected[3:3 + 45] = False
    expected[3 + 50 + ahead + 1: 103] = False
    assert torch.equal(keep, expected.expand(2, -1))
    w.reading.position, w.reading.floor = 99, 0
    assert w.window() == (99 - behind, 100)
    expected = torch.ones(110, dtype=torch.bool)
    expected[3:3 + 99 - behind] = False  # the window reaches the audio's end, not its start
    assert torch.equal(w.keep(n_kv_heads=1, n_keys=110), expected[None])
    assert ReadWindow(cfg, 3, n_audio=20, audio_tokens_per_s=RATE).keep(2, 30) is None  # all audio in the window


def _layer(idx: int) -> SimpleNamespace:
    return SimpleNamespace(layer_idx=idx, scaling=0.5, is_causal=True, num_key_value_groups=2)


def _spiked_keys(n_keys: int, at: int, d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A query and keys whose attention peaks at key ``at`` in every head."""
    gen = torch.Generator().manual_seed(at)
    q = torch.ones(1, 4, 1, d)
    k = torch.randn(1, 2, n_keys, d, generator=gen) * 0.1
    k[:, :, at] = 3.0
    return q, k


def test_aligning_layer_decode_step_reads_the_window_and_moves_the_position():
    cfg = ReadWindowConfig(behind_s=0.5, ahead_s=1.0, stall_tokens=8, layers=(1, 2))
    w = ReadWindow(cfg, audio_start=2, n_audio=60,
                   audio_tokens_per_s=RATE)
    n_keys = 2 + 60 + 3
    q, k = _spiked_keys(n_keys, at=2 + 9)  # audio token 9, inside the first window
    v = torch.randn(1, 2, n_keys, 4, generator=torch.Generator().manual_seed(1))
    keep = w.keep(2, n_keys)
    out, _ = w.attention(_layer(1), 1, q, k, v, None, scaling=0.3)  # the call's scaling, not the layer's
    assert torch.equal(out, masked_decode_attention(q, k, v, keep, 0.3))
    assert w.reading.position == 0  # moved only after the last aligning layer
    w.attention(_layer(2), 2, q, k, v, None, scaling=0.5)
    assert w.reading.position == 9 and w.reading.path == [9]
    # a peak outside the window cannot pull the reading there: audio token 40 is masked
    q, k = _spiked_keys(n_keys, at=2 + 40)
    for layer in (1, 2):
        w.attention(_layer(layer), layer, q, k, v, None, scaling=0.5)
    assert w.reading.position <= 9 + round(1.0 * RATE)


def _two_targets(strengths: list[float], n_keys: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A query per head (4 heads over 2 KV heads) and keys: head h attends to audio token 5 or
    8 (key 2 + 5 or 2 + 8) with logit |strengths[h]|, to 5 where it is positive."""
    k = torch.zeros(1, 2, n_keys, 4)
    k[:, :, 2 + 5, 0] = 1.0
    k[:, :, 2 + 8, 1] = 1.0
    q = torch.zeros(1, 4, 1, 4)
    for h, s in enumerate(strengths):
        q[0, h, 0, 0 if s > 0 else 1] = abs(s) / 0.5  # the layer's scaling is 0.5
    return q, k


def test_the_peak_is_of_the_head_mean_summed_over_the_aligning_layers():
    v = torch.zeros(1, 2, 64, 4)
    # three heads at audio token 5 with half their mass there, one at 8 with all of it: the
    # head mean peaks at 5 (the strongest single head at 8)
    w = ReadWindow(ReadWindowConfig(behind_s=5, ahead_s=5, layers=(1,)), audio_start=2, n_audio=60,
                   audio_tokens_per_s=RATE)
    q, k = _two_targets([4.1, 4.1, 4.1, -12.0])
    w.attention(_layer(1), 1, q, k, v, None, scaling=0.5)
    assert w.reading.position == 5
    # layer 1 sure of token 5, layer 2 less sure of 8: their sum peaks at 5
    w = ReadWindow(ReadWindowConfig(behind_s=5, ahead_s=5, layers=(1, 2)), audio_start=2, n_audio=60,
                   audio_tokens_per_s=RATE)
    w.attention(_layer(1), 1, *_two_targets([12.0] * 4), v, None, scaling=0.5)
    w.attention(_layer(2), 2, *_two_targets([-4.1] * 4), v, None, scaling=0.5)
    assert w.reading.position == 5


def _masked_call(hidden: int) -> tuple[torch.Tensor, ...]:
    """A decode query, keys peaking at key 150, values and a mask that hides key ``hidden``
    (210 keys: 200 audio tokens from 0, 10 more)."""
    q, k = _spiked_keys(210, at=150)
    v = torch.randn(1, 2, 210, 4, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 1, 1, 210, dtype=torch.bool)
    mask[..., hidden] = False
    return q, k, v, mask


def test_other_layers_and_the_prefill_run_stock_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    w = ReadWindow(ReadWindowConfig(layers=(1,)), audio_start=0, n_audio=200, audio_tokens_per_s=RATE)
    # the call's mask and scaling reach sdpa (a mask that hides the spike, a scaling not the layer's)
    q, k, v, mask = _masked_call(hidden=150)
    stock, _ = sdpa_attention_forward(_layer(0), q, k, v, mask, scaling=0.3)
    out, _ = w.attention(_layer(0), 0, q, k, v, mask, scaling=0.3)
    assert torch.equal(out, stock)
    assert not torch.equal(out, sdpa_attention_forward(_layer(0), q, k, v, None, scaling=0.5)[0])
    prefill_q, prefill_mask = torch.ones(1, 4, 5, 4), mask.expand(1, 1, 5, 210)
    stock, _ = sdpa_attention_forward(_layer(1), prefill_q, k, v, prefill_mask, scaling=0.3)
    out, _ = w.attention(_layer(1), 1, prefill_q, k, v, prefill_mask, scaling=0.3)
    assert torch.equal(out, stock)
    assert w.reading.path == []


def test_an_aligning_layer_whose_window_holds_all_audio_runs_stock_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    w = ReadWindow(ReadWindowConfig(behind_s=100, ahead_s=100, layers=(1,)), audio_start=0, n_audio=200,
                   audio_tokens_per_s=RATE)
    q, k, v, mask = _masked_call(hidden=7)
    stock, _ = sdpa_attention_forward(_layer(1), q, k, v, mask, scaling=0.3)
    out, _ = w.attention(_layer(1), 1, q, k, v, mask, scaling=0.3)
    assert torch.equal(out, stock) and w.reading.path == [150]


def test_the_other_layers_reach_is_around_the_position_without_the_floor():
    cfg = ReadWindowConfig(behind_s=1.0, ahead_s=2.0, layers=(1,), others_s=(4.0, 2.0))
    w = ReadWindow(cfg, audio_start=3, n_audio=200, audio_tokens_per_s=RATE)
    w.reading.position, w.reading.floor = 120, 118
    assert w.others_window() == (120 - 50, 120 + 25 + 1)  # 4 s and 2 s at 12.5 tokens/s
    w.reading.position = 10
    assert w.others_window() == (0, 10 + 25 + 1)
    w.reading.position = 199
    assert w.others_window() == (199 - 50, 200)
    ahead_only = ReadWindow(replace(cfg, others_s=(math.inf, 2.0)), 3, 200, RATE)
    ahead_only.reading.position = 120
    assert ahead_only.others_window() == (0, 146)
    behind_only = ReadWindow(replace(cfg, others_s=(0.0, math.inf)), 3, 200, RATE)
    behind_only.reading.position = 120
    assert behind_only.others_window() == (120, 200)
    assert not ReadWindowConfig().limits_others and cfg.limits_others
    with pytest.raises(ValueError, match="reach"):
        ReadWindowConfig(others_s=(1.0, 0.0))


def test_a_limited_reach_masks_the_other_layers_decode_steps_only():
    cfg = ReadWindowConfig(behind_s=1.0, ahead_s=1.0, layers=(1,), others_s=(2.0, 1.0))
    w = ReadWindow(cfg, audio_start=0, n_audio=200, audio_tokens_per_s=RATE)
    w.reading.position = 100
    q, k, v, mask = _masked_call(hidden=7)
    out, _ = w.attention(_layer(0), 0, q, k, v, mask, scaling=0.3)
    keep = torch.ones(2, 210, dtype=torch.bool)
    keep[:, :100 - 25] = False
    keep[:, 100 + 12 + 1:200] = False  # the spike at 150 is out of reach; the text after stays
    assert torch.equal(out, masked_decode_attention(q, k, v, keep, 0.3))
    assert torch.equal(w.keep(2, 210, w.others_window()), keep)
    assert w.reading.path == []  # only the aligning layers move the position
    # the aligning layer keeps its own, narrower window in the same step
    window_keep = w.keep(2, 210)
    assert not torch.equal(window_keep, keep)
    # each kind of layer's mask is built once per step, however the layers interleave
    assert w.keep(2, 210, w.others_window()) is w.keep(2, 210, w.others_window())
    assert w.keep(2, 210) is window_keep
    aligned, _ = w.attention(_layer(1), 1, q, k, v, mask, scaling=0.3)
    assert torch.equal(aligned, masked_decode_attention(q, k, v, window_keep, 0.3))
    # a reach that holds all audio runs stock sdpa, the call's mask included
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    wide = ReadWindow(replace(cfg, others_s=(100.0, 100.0)), 0, 200, RATE)
    out, _ = wide.attention(_layer(0), 0, q, k, v, mask, scaling=0.3)
    assert torch.equal(out, sdpa_attention_forward(_layer(0), q, k, v, mask, scaling=0.3)[0])


def test_the_others_reach_option_needs_the_window_is_recorded_and_not_live():
    from kvsim.minivox.evaluate import _others_reach, _read_window

    assert _read_window("2,3,8", "40,inf").others_s == (40.0, math.inf)
    assert _read_window("2,3,8", None).others_s == (math.inf, math.inf)
    with pytest.raises(ValueError, match="--others-reach: needs --read-window"):
        _read_window(None, "40,20")
    with pytest.raises(ValueError, match=re.escape("--others-reach '40': BEHIND,AHEAD")):
        _read_window("2,3,8", "40")
    with pytest.raises(ValueError, match=re.escape("--others-reach '40,0': read window")):
        _read_window("2,3,8", "40,0")
    assert _others_reach(_read_window("2,3,8", "40,inf")) == {"others_reach": "40,inf"}
    assert _others_reach(_read_window("2,3,8", "inf,20")) == {"others_reach": "inf,20"}
    assert _others_reach(_read_window("2,3,8", None)) == {} == _others_reach(None)
    from kvsim.live.decode import LiveConfig
    from kvsim.live.decode import _read_window as live_read_window

    lm = SimpleNamespace(layout=SimpleNamespace(n_layers=30), name="minivox")
    with pytest.raises(ValueError, match="diagnostic of python -m kvsim.minivox.evaluate"):
        live_read_window(lm, None, LiveConfig(read_window=_read_window("2,3,8", "40,inf")))


@pytest.fixture(scope="module")
def tiny():
    from kvsim.minivox.processing import MinivoxProcessor

    tok = _tiny_tokenizer()
    model = _tiny_model(len(tok))
    model.set_attn_implementation({"text_config": register_read_window()})
    return model, MinivoxProcessor(tok, "<empty_output>")


def _audio(seconds: float) -> np.ndarray:
    return (np.random.default_rng(5).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)


def test_a_window_wider_than_the_audio_decodes_exactly_as_plain_greedy(tiny):
    model, proc = tiny
    inp = proc(audio=_audio(3))
    plain = model.generate(**inp, max_new_tokens=12, do_sample=False)  # no window active
    wide = ReadWindowConfig(behind_s=100, ahead_s=100, stall_tokens=10_000, layers=(1, 2))
    window = ReadWindow.for_inputs(wide, inp["input_ids"], proc.audio_token_id, RATE)
    with reading_with(window):
        windowed = model.generate(**inp, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, windowed)
    assert len(window.reading.path) == 11  # every decode step after the prefill's token


def test_decoding_stops_once_forced_steps_leave_the_audio(tiny):
    model, proc = tiny
    audio = _audio(2)
    n_audio = proc.num_audio_tokens(audio.size)
    opts = EvalOptions(read_window=ReadWindowConfig(0.2, 0.4, 1, layers=(1, 2)))
    dec = decode_clip(model, proc, audio, ref_words=400, opts=opts, options=generation_options())
    # every token moves the position at least one audio token, so the audio runs out first
    assert dec.read_stopped and dec.n_gen <= n_audio + 2 < 400
    plain = decode_clip(model, proc, audio, ref_words=400, opts=EvalOptions(),
                        options=generation_options())
    assert not plain.read_stopped and plain.n_gen == int(400 * 1.7) + 10


def test_for_inputs_needs_one_contiguous_run_of_audio_tokens():
    cfg = ReadWindowConfig()
    ids = torch.tensor([[1, 3, 3, 3, 2]])
    w = ReadWindow.for_inputs(cfg, ids, audio_token_id=3, audio_tokens_per_s=RATE)
    assert (w.audio_start, w.reading.n_audio) == (1, 3)
    one = ReadWindow.for_inputs(cfg, torch.tensor([[1, 3, 2]]), audio_token_id=3, audio_tokens_per_s=RATE)
    assert (one.audio_start, one.reading.n_audio) == (1, 1)
    with pytest.raises(ValueError, match="^read window: the prompt.s audio tokens are missing or not contiguous$"):
        ReadWindow.for_inputs(cfg, torch.tensor([[1, 2]]), audio_token_id=3, audio_tokens_per_s=RATE)
    with pytest.raises(ValueError, match="not contiguous"):
        ReadWindow.for_inputs(cfg, torch.tensor([[3, 1, 3]]), audio_token_id=3, audio_tokens_per_s=RATE)
    with pytest.raises(ValueError, match="batch of 2"):
        ReadWindow.for_inputs(cfg, ids.expand(2, -1), audio_token_id=3, audio_tokens_per_s=RATE)


@pytest.mark.parametrize("spec, message", [
    ("2,3", "BEHIND,AHEAD,STALL"), ("2,x,8", "could not convert"), ("2,3,0", "stall"),
    ("-1,3,8", "behind"), ("2,0,8", "ahead"), ("nan,3,8", "behind"), ("2,inf,8", "ahead"),
])
def test_read_window_spec_errors_name_the_option(spec, message):
    with pytest.raises(ValueError, match=message):
        ReadWindowConfig.parse(spec)


def test_read_window_spec_round_trips_and_the_cli_rejects_a_bad_one(capsys):
    cfg = ReadWindowConfig.parse("2,3,8")
    assert cfg == ReadWindowConfig(2.0, 3.0, 8) and cfg.spec() == "2,3,8"
    assert cfg.layers == (20, 21, 22, 23)
    with pytest.raises(SystemExit, match="--read-window '2,3': BEHIND,AHEAD,STALL"):
        main(["--read-window", "2,3"])


@pytest.mark.parametrize("spec, layers", [
    ("2,3,8", (20, 21, 22, 23)), ("2,3,8,20-23", (20, 21, 22, 23)), ("1,1.5,3,0-1", (0, 1)),
    ("2,3,8,4+9-11", (4, 9, 10, 11)), ("2,3,8,7", (7,)),
])
def test_read_window_layers_parse_and_round_trip(spec, layers):
    cfg = ReadWindowConfig.parse(spec)
    assert cfg.layers == layers
    assert ReadWindowConfig.parse(cfg.spec()) == cfg
    assert cfg.spec() == (spec if layers != (20, 21, 22, 23) else "2,3,8")


@pytest.mark.parametrize("spec, message", [
    ("2,3,8,3-1", "FIRST-LAST"), ("2,3,8,1+1", "given twice"), ("2,3,8,x", "invalid literal"),
    ("2,3,8,-1", "invalid literal"), ("2,3,8,1,2", "BEHIND,AHEAD,STALL"),
])
def test_read_window_bad_layers_name_the_option(spec, message):
    with pytest.raises(ValueError, match=f"--read-window '{re.escape(spec)}'.*{message}"):
        ReadWindowConfig.parse(spec)
