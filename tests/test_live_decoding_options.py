"""Live decoding with the read window and the cycle ban (kvsim.decoding.read_window, .cycle_ban):
the same decoding as ``generate`` with them, composed with what a policy keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

from kvsim.decoding.cycle_ban import CycleBan, CycleBanConfig
from kvsim.decoding.hold_end import HoldEnd
from kvsim.decoding.read_window import (
    ReadPastEnd,
    ReadWindow,
    ReadWindowConfig,
    reading_with,
    register_read_window,
)
from kvsim.live.decode import LiveConfig, live_generate, prefill_once
from kvsim.live.models import TinyBackbone, TinyConfig
from kvsim.policies.base import HeadScores
from kvsim.replay.engine import PolicySpec
from tests.test_cycle_ban import _longest_run

torch.set_num_threads(1)
SHAPE = TinyConfig(n_layers=3, n_q_heads=8, n_kv_heads=4, head_dim=16)
N_NEW = 60
#: narrow enough to move and to be pushed on the tiny backbone's 16 s prompt (200 audio tokens)
WINDOW = ReadWindowConfig(behind_s=1.0, ahead_s=1.5, stall_tokens=3, layers=(1, 2))
BAN = CycleBanConfig(max_period=4, repeats=3)


@pytest.fixture(scope="module")
def lm():
    return TinyBackbone(SHAPE)


@pytest.fixture(scope="module")
def prompt(lm):
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 16)).astype(np.float32)
    audio[: 16000 * 4] *= np.linspace(0, 3, 16000 * 4, dtype=np.float32)
    return lm.prepare(audio)


@pytest.fixture(scope="module")
def scores():
    rng = np.random.default_rng(1)
    return HeadScores(rng.random((3, 4)), rng.random((3, 4)), source="test")


def _generate_with_options(prompt, window_cfg, ban_cfg, n_new) -> tuple[list[int], ReadWindow, CycleBan]:
    """The reference: stock ``generate`` on a second copy of the tiny backbone whose decoder
    runs the read window's own attention function, with the ban as a logits processor."""
    ref = TinyBackbone(SHAPE)
    ref.model.set_attn_implementation(register_read_window())
    audio = prompt.audio_positions
    window = ReadWindow(window_cfg, int(audio[0]), len(audio), ref.audio_tokens_per_s)
    ban = CycleBan(ban_cfg, prompt_length=0)  # inputs_embeds: generate sees only new tokens
    with torch.no_grad(), reading_with(window):
        out = ref.model.generate(**prompt.prefill_inputs(), max_new_tokens=n_new, do_sample=False,
                                 num_beams=1, logits_processor=LogitsProcessorList([ban]),
                                 stopping_criteria=ReadPastEnd.criteria(window))
    return out[0].tolist(), window, ban


def test_live_full_cache_with_both_options_decodes_as_generate_with_them(lm, prompt):
    expected, window, ban = _generate_with_options(prompt, WINDOW, BAN, N_NEW)
    cfg = LiveConfig(max_new_tokens=N_NEW, read_window=WINDOW, ban_cycles=BAN)
    run = live_generate(lm, prompt, PolicySpec("full", 1.0), cfg)
    assert ban.fired > 0 and window.reading.forced > 0  # both options acted
    assert any(w != (0, prompt.n_audio) for w in window.windows)
    assert run.tokens == expected
    assert run.extra["read_windows"] == window.windows
    s = run.summary
    assert (s["read_window"], s["ban_cycles"]) == (WINDOW.spec(), BAN.spec())
    assert (s["cycle_bans"], s["read_forced"]) == (ban.fired, window.reading.forced)
    assert max(_longest_run(run.tokens, p) for p in range(1, 5)) <= 3


@pytest.fixture(scope="module")
def with_an_end(prompt):
    """A tiny backbone whose end token is its plain first token on ``prompt``: plain greedy
    decoding ends at once; and a second copy of it for ``generate`` with the read window's
    attention (the reference)."""
    lm, ref = TinyBackbone(SHAPE), TinyBackbone(SHAPE)
    first = live_generate(lm, prompt, PolicySpec("full", 1.0), LiveConfig(1)).tokens[0]
    for backbone in (lm, ref):
        backbone.model.generation_config.eos_token_id = first
    ref.model.set_attn_implementation(register_read_window())
    return lm, ref, first


HOLD_S = 2.0


def _padded(prompt, n_padding: int):
    """``prompt`` with its last ``n_padding`` audio tokens marked as encoder padding."""
    import dataclasses

    marks = np.zeros(prompt.n_audio, dtype=bool)
    marks[prompt.n_audio - n_padding:] = True
    return dataclasses.replace(prompt, audio_padding=marks)


def test_live_with_a_held_end_decodes_as_generate_with_it(with_an_end, prompt):
    lm, ref, eos = with_an_end
    plain = live_generate(lm, prompt, PolicySpec("full", 1.0), LiveConfig(N_NEW, read_window=WINDOW))
    assert plain.tokens == [eos] and plain.summary["end_holds"] == 0
    prompt = _padded(prompt, 60)  # the end of the speech: 140 of the 200 audio tokens
    audio = prompt.audio_positions
    window = ReadWindow(WINDOW, int(audio[0]), len(audio), ref.audio_tokens_per_s)
    ban, hold = CycleBan(BAN, prompt_length=0), HoldEnd(window, len(audio) - 60, HOLD_S, [eos], 12.5)
    with torch.no_grad(), reading_with(window):
        out = ref.model.generate(**prompt.prefill_inputs(), max_new_tokens=N_NEW, do_sample=False,
                                 num_beams=1, logits_processor=LogitsProcessorList([ban, hold]),
                                 stopping_criteria=ReadPastEnd.criteria(window))
    cfg = LiveConfig(N_NEW, read_window=WINDOW, ban_cycles=BAN, hold_end=HOLD_S)
    run = live_generate(lm, prompt, PolicySpec("full", 1.0), cfg)
    assert hold.held > 0 and len(run.tokens) > 1  # the end was held: decoding went on
    assert run.tokens == out[0].tolist()
    assert (run.summary["hold_end"], run.summary["end_holds"]) == (HOLD_S, hold.held)
    assert run.summary["cycle_bans"] == ban.fired
    shared = live_generate(lm, prompt, PolicySpec("full", 1.0), cfg, prefilled=prefill_once(lm, prompt))
    assert shared.tokens == run.tokens  # the first token held from a shared prefill too
    assert cfg.decoding_options() == {"read_window": WINDOW.spec(), "ban_cycles": BAN.spec(),
                                      "hold_end": "2"}


def test_a_held_end_lets_the_answer_end_only_near_the_end_of_the_speech(with_an_end, prompt):
    lm, _, eos = with_an_end
    cfg = LiveConfig(400, read_window=WINDOW, hold_end=HOLD_S)
    run = live_generate(lm, prompt, PolicySpec("snapkv", 0.5), cfg)
    assert eos not in run.tokens[:-1] and run.summary["end_holds"] > 0 and run.terminated
    end = prompt.n_audio - round(HOLD_S * lm.audio_tokens_per_s)
    ended_at = run.extra["read_windows"][-1]
    # the last step's window is around a position at least ``end``: it reaches past it
    assert run.tokens[-1] != eos or ended_at[1] > end
    assert run.tokens[-1] == eos or run.summary["read_stopped"]


def test_a_held_end_needs_the_window_and_the_prompts_padding_marks(lm, prompt):
    import dataclasses

    with pytest.raises(ValueError, match="--hold-end: needs --read-window"):
        LiveConfig(8, hold_end=3.0)
    with pytest.raises(ValueError, match="--hold-end -1: seconds >= 0"):
        LiveConfig(8, read_window=WINDOW, hold_end=-1)
    unmarked = dataclasses.replace(prompt, audio_padding=None)
    with pytest.raises(ValueError, match="tiny does not mark the encoder padding"):
        live_generate(lm, unmarked, PolicySpec("full", 1.0), LiveConfig(8, read_window=WINDOW, hold_end=1.0))


def test_a_window_that_holds_all_audio_changes_no_policy_run(lm, prompt, scores):
    wide = ReadWindowConfig(behind_s=100, ahead_s=100, stall_tokens=10_000, layers=(1, 2))
    for name, budget in (("snapkv", 0.3), ("wnw", 0.3), ("arkvale", 0.3)):
        plain = live_generate(lm, prompt, PolicySpec(name, budget), LiveConfig(N_NEW, head_scores=scores))
        windowed = live_generate(lm, prompt, PolicySpec(name, budget),
                                 LiveConfig(N_NEW, head_scores=scores, read_window=wide))
        assert windowed.tokens == plain.tokens, name
        assert windowed.step_log.equals(plain.step_log), name
        assert not windowed.summary["read_stopped"] and windowed.summary["cycle_bans"] == 0


def test_aligning_layers_read_the_window_of_what_the_policy_keeps(lm, prompt, scores):
    cfg = LiveConfig(N_NEW, head_scores=scores, record_tiers=True, read_window=WINDOW)
    run = live_generate(lm, prompt, PolicySpec("h2o", 0.5), cfg)
    windows = run.extra["read_windows"]
    assert len(windows) == len(run.step_attention) > 0
    outside_window_at_layer0 = 0.0
    for step, (att, (lo, hi)) in enumerate(zip(run.step_attention, windows, strict=True)):
        on_gpu = np.repeat(run.tiers[step] == 2, SHAPE.n_q_heads // SHAPE.n_kv_heads, axis=1)
        assert not att[~on_gpu].any()  # every layer: nothing off the policy's GPU tier
        for layer in WINDOW.layers:  # the aligning layers: nothing outside the window either
            assert not att[layer][:, :lo].any() and not att[layer][:, hi:].any()
            assert np.allclose(att[layer].sum(axis=1), att[layer][:, lo:hi].sum(axis=1))
        outside_window_at_layer0 += att[0][:, :lo].sum() + att[0][:, hi:].sum()
    assert outside_window_at_layer0 > 0  # other layers read the rest of what is kept


@pytest.mark.parametrize("name, budget", [("wnw", 0.3), ("arkvale", 0.3)])
def test_physical_offload_with_the_window_matches_masking(lm, prompt, scores, name, budget):
    runs = [live_generate(lm, prompt, PolicySpec(name, budget),
                          LiveConfig(N_NEW, physical=p, head_scores=scores, read_window=WINDOW,
                                     ban_cycles=BAN))
            for p in (False, True)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].extra["read_windows"] == runs[1].extra["read_windows"]


def test_arkvale_selecting_on_the_device_with_the_window_decodes_as_on_the_host(lm, prompt, scores):
    runs = [live_generate(lm, prompt, PolicySpec("arkvale", 0.3),
                          LiveConfig(N_NEW, head_scores=scores, read_window=WINDOW, device_select=d))
            for d in (False, True)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].step_log.equals(runs[1].step_log)


def test_the_run_ends_when_the_window_leaves_the_audio(lm, prompt):
    pushed = ReadWindowConfig(behind_s=0.2, ahead_s=0.4, stall_tokens=1, layers=(1, 2))
    run = live_generate(lm, prompt, PolicySpec("full", 1.0), LiveConfig(400, read_window=pushed))
    # every decode step moves the position at least one audio token: the audio runs out first
    assert run.summary["read_stopped"] and run.terminated
    assert len(run.tokens) <= prompt.n_audio + 2 < 400


def test_a_window_the_model_or_prompt_cannot_take_is_refused(lm, prompt):
    deep = ReadWindowConfig(layers=(20, 21, 22, 23))
    with pytest.raises(ValueError, match="aligning layer 23 of a 3-layer decoder"):
        live_generate(lm, prompt, PolicySpec("full", 1.0), LiveConfig(8, read_window=deep))


def _clips(folder, n=2, seconds=6):
    import soundfile as sf

    rng = np.random.default_rng(0)
    folder.mkdir(exist_ok=True)
    for i in range(n):
        sf.write(str(folder / f"c{i}.wav"), (0.1 * rng.standard_normal(16000 * seconds)).astype(np.float32), 16000)
        (folder / f"c{i}.txt").write_text("some reference words here")
    return folder


def test_live_cli_records_the_options_and_what_they_did(tmp_path):
    import json

    import polars as pl
    from typer.testing import CliRunner

    from kvsim.cli import app

    clips, out = _clips(tmp_path / "clips"), tmp_path / "out"
    res = CliRunner().invoke(app, ["live", str(clips), "--model", "tiny", "-p", "full,snapkv", "-b", "0.5",
                                   "--max-new-tokens", "20", "--read-window", "0.5,1,3,0-1",
                                   "--ban-cycles", "4,2", "--hold-end", "0.5", "--no-plot", "-o", str(out)])
    assert res.exit_code == 0, res.output
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["read_window"], config["ban_cycles"], config["hold_end"]) == ("0.5,1,3,0-1", "4,2", "0.5")
    runs = pl.read_parquet(out / "runs.parquet")
    assert set(runs["read_window"]) == {"0.5,1,3,0-1"} and set(runs["ban_cycles"]) == {"4,2"}
    assert set(runs["hold_end"]) == {0.5} and "end_holds" in runs.columns
    assert runs["cycle_bans"].sum() > 0 and runs["read_forced"].sum() > 0
    results = pl.read_parquet(out / "results.parquet").sort("policy")
    assert results["read_window"].to_list() == ["0.5,1,3,0-1"] * 2
    for policy in ("full", "snapkv"):
        mine = runs.filter(pl.col("policy") == policy)
        row = results.filter(pl.col("policy") == policy)
        assert row["cycle_bans"][0] == pytest.approx(mine["cycle_bans"].mean())
        assert row["end_holds"][0] == pytest.approx(mine["end_holds"].mean())
        assert row["hold_end"][0] == 0.5
        assert row["read_stop_rate"][0] == pytest.approx(mine["read_stopped"].cast(pl.Float64).mean())
    plain = tmp_path / "plain"
    res = CliRunner().invoke(app, ["live", str(clips), "--model", "tiny", "--max-new-tokens", "20",
                                   "--no-plot", "-o", str(plain)])
    assert res.exit_code == 0, res.output
    assert "read_window" not in json.loads((plain / "run.json").read_text())["config"]  # as before


@pytest.mark.parametrize("args, message", [
    (["--read-window", "2,3,8"], "aligning layer 23 of a 2-layer decoder (tiny); give its aligning layers"),
    (["--read-window", "2,3"], "--read-window '2,3': BEHIND,AHEAD,STALL[,LAYERS]"),
    (["--read-window", "2,3,8,1-0"], "layers '1-0': FIRST-LAST"),
    (["--ban-cycles", "0,3"], "--ban-cycles '0,3': cycle ban: period 0"),
    (["--hold-end", "3"], "--hold-end: needs --read-window"),
    (["--read-window", "0.5,1,3,0-1", "--hold-end", "-2"], "--hold-end -2.0: seconds >= 0"),
])
def test_live_cli_refuses_an_option_in_one_line_before_decoding(tmp_path, args, message):
    from typer.testing import CliRunner

    from kvsim.cli import app

    res = CliRunner().invoke(app, ["live", str(_clips(tmp_path / "clips", n=1)), "--model", "tiny",
                                   *args, "-o", str(tmp_path / "out")])
    assert res.exit_code == 2 and message in " ".join(res.output.split())
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_table5_refuses_runs_decoded_with_other_options(tmp_path):
    from typer.testing import CliRunner

    from kvsim.cli import app
    from tests.study_tiny import tiny_heads

    clips, heads = _clips(tmp_path / "clips", n=1), tiny_heads(tmp_path / "heads.json")
    for name, extra in (("plain", []), ("guided", ["--read-window", "0.5,1,3,0-1"]),
                        ("held", ["--read-window", "0.5,1,3,0-1", "--hold-end", "0.5"])):
        res = CliRunner().invoke(app, ["live", str(clips), "--model", "tiny", "--max-new-tokens", "6",
                                       "--no-plot", *extra, "-o", str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    study = ["study", "table5", "--model", "tiny", "--max-new-tokens", "6", "-b", "0.3", "--heads", str(heads),
             "--runs-only"]
    res = CliRunner().invoke(app, [*study, "--live-runs", str(tmp_path / "plain"), "--read-window",
                                   "0.5,1,3,0-1", "-o", str(tmp_path / "t1")])
    assert res.exit_code == 2 and "config field 'read_window' is None" in " ".join(res.output.split())
    res = CliRunner().invoke(app, [*study, "--live-runs", str(tmp_path / "guided"), "-o", str(tmp_path / "t2")])
    assert res.exit_code == 2 and "'read_window' is '0.5,1,3,0-1', this study runs with None" in " ".join(res.output.split())
    res = CliRunner().invoke(app, [*study, "--live-runs", str(tmp_path / "guided"), "--read-window",
                                   "0.5,1,3,0-1", "-o", str(tmp_path / "t3")])
    assert res.exit_code == 0, res.output
    assert "--read-window 0.5,1,3,0-1" in (tmp_path / "t3" / "table5.md").read_text()
    res = CliRunner().invoke(app, [*study, "--live-runs", str(tmp_path / "held"), "--read-window",
                                   "0.5,1,3,0-1", "-o", str(tmp_path / "t4")])
    assert res.exit_code == 2 and "'hold_end' is '0.5', this study runs with None" in " ".join(res.output.split())
    res = CliRunner().invoke(app, [*study, "--live-runs", str(tmp_path / "held"), "--read-window",
                                   "0.5,1,3,0-1", "--hold-end", "0.5", "-o", str(tmp_path / "t5")])
    assert res.exit_code == 0, res.output
    assert "(`--hold-end 0.5`)" in (tmp_path / "t5" / "table5.md").read_text()


def test_the_study_names_every_decoding_option_in_one_sentence():
    from kvsim.studies.table5 import decoding_options_note

    note = decoding_options_note({"read_window": "2,3,8", "ban_cycles": "16,3", "hold_end": "3"})
    assert ("(`--read-window 2,3,8`), a ban on short loops (`--ban-cycles 16,3`) and the end of answer "
            "held until the read position is within 3 s of the end of the speech (`--hold-end 3`);") in note
    assert "(`--read-window 2,3,8`) and a ban on short loops (`--ban-cycles 16,3`);" in decoding_options_note(
        {"read_window": "2,3,8", "ban_cycles": "16,3"})
