"""Which heads.json a command reads: the one given, else minivox's shipped one for minivox."""

from __future__ import annotations

from pathlib import Path

from kvsim.commands._options import calibration_for
from kvsim.minivox import SHIPPED_HEADS
from kvsim.trace.heads import read_heads


def test_given_file_wins_and_only_minivox_has_a_default():
    mine = Path("elsewhere/heads.json")
    assert calibration_for("minivox", mine) == mine
    assert calibration_for("voxtral-mini", mine) == mine
    assert calibration_for("minivox", None) == SHIPPED_HEADS
    for model in ("voxtral-mini", "qwen-omni", "tiny", "checkpoints/minivox"):
        assert calibration_for(model, None) is None


def test_another_adapter_gets_no_default(tmp_path, monkeypatch):
    other = tmp_path / "mine.safetensors"
    other.write_bytes(b"")
    monkeypatch.setenv("MINIVOX_ADAPTER", str(other))
    assert calibration_for("minivox", None) is None
    from kvsim.minivox.build import REPO_WEIGHTS

    monkeypatch.setenv("MINIVOX_ADAPTER", str(REPO_WEIGHTS))
    assert calibration_for("minivox", None) == SHIPPED_HEADS


def test_the_shipped_scores_are_minivox_shaped_and_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert SHIPPED_HEADS.is_absolute()
    scores = read_heads(SHIPPED_HEADS)
    # SmolLM2-135M: 30 layers, 3 KV-heads (minivox/MODEL_CARD.md)
    assert scores.voice_score.shape == (30, 3)


def test_the_studies_default_to_the_same_file():
    from kvsim.studies.table4 import Table4Config
    from kvsim.studies.table5 import Table5Config

    assert Table4Config().heads == SHIPPED_HEADS
    assert Table5Config().heads == SHIPPED_HEADS


def _sweep_args(traces, model, no_replay=False):
    from kvsim.commands.study._wnw_sweep import SweepArgs

    return SweepArgs(traces=traces, heads=None, calibration_traces=None,
                     dataset_root=Path("data/minivox"), limit=2, max_new_tokens=8,
                     no_live=not no_replay, no_replay=no_replay, model=model, device="cpu",
                     ray=None, max_steps=None, quick=True, out=Path("unused"))


def test_the_wnw_sweeps_default_only_minivox_to_its_scores():
    """``kvsim study table3/table7`` without --calibration: minivox gets its shipped scores;
    another model's traces are replayed with the scores they carry and sized by their layout."""
    from kvsim.commands.study._wnw_sweep import sweep_options
    from kvsim.specs import default_trace_dir
    from kvsim.trace.reader import Trace

    opts, n_heads = sweep_options(_sweep_args(None, "minivox"))
    assert opts.heads == SHIPPED_HEADS and n_heads == read_heads(SHIPPED_HEADS).voice_score.size
    other = default_trace_dir() / "synth-qwen-omni-5s.kvtrace"
    lay = Trace(other).head_layout
    opts, n_heads = sweep_options(_sweep_args([other], "qwen-omni"))
    assert opts.heads is None
    assert n_heads == lay.n_layers * lay.n_kv_heads != read_heads(SHIPPED_HEADS).voice_score.size


def test_a_live_only_sweep_of_another_model_asks_for_its_scores():
    import pytest

    from kvsim.commands.study._wnw_sweep import sweep_options

    with pytest.raises(ValueError, match="--calibration") as info:
        sweep_options(_sweep_args(None, "qwen-omni", no_replay=True))
    assert "\n" not in str(info.value)


def test_a_calibration_of_another_model_refuses_only_the_policies_that_read_it():
    """minivox's scores (30 × 3) given for a qwen-omni trace: the policies that need head
    scores are refused for that trace, naming both shapes; SnapKV still runs."""
    from kvsim.replay.engine import PolicySpec, ReplayConfig, Replayer
    from kvsim.specs import default_trace_dir
    from kvsim.trace.reader import Trace

    trace = Trace(default_trace_dir() / "synth-qwen-omni-5s.kvtrace")
    rep = Replayer(trace, ReplayConfig(head_scores=read_heads(SHIPPED_HEADS)))
    runs = rep.run([PolicySpec("snapkv", 0.4), PolicySpec("wnw", 0.4), PolicySpec("audiokv", 0.4)])
    assert [r.spec.name for r in runs] == ["snapkv"]
    assert [s.name for s, _ in rep.failures] == ["wnw", "audiokv"]
    for _, why in rep.failures:
        assert "(30, 3)" in str(why) and "(36, 2)" in str(why) and "\n" not in str(why)
