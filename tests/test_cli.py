"""The kvsim command line, driven as a user drives it."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl
from typer.testing import CliRunner

from kvsim.cli import app
from tests.conftest import make_trace

runner = CliRunner()


def test_replay_end_to_end_with_plot(tmp_path: Path) -> None:
    make_trace(tmp_path / "tr" / "a.kvtrace", preset="small", seconds=12, steps=10, seed=1)
    make_trace(tmp_path / "tr" / "b.kvtrace", preset="small", seconds=10, steps=8, seed=2)
    out = tmp_path / "run"
    res = runner.invoke(app, ["replay", str(tmp_path / "tr"), "-p", "full,snapkv:window=8", "-p", "streaming",
                              "-b", "0.2,0.6", "-o", str(out), "--plot", "--jobs", "2"])
    assert res.exit_code == 0, res.output
    table = pl.read_parquet(out / "results.parquet")
    assert table.height == 2 * 3 * 2
    assert set(table["label"]) == {"full", "snapkv(window=8)", "streaming"}
    assert (out / "recall_vs_rgpu.html").stat().st_size > 1000
    assert (out / "recall_vs_rgpu.png").read_bytes()[:4] == b"\x89PNG"
    html = (out / "recall_vs_rgpu.html").read_text()
    assert "<script" in html and not re.search(r"<script[^>]*\bsrc=", html)  # opens offline
    steps = sorted((out / "steps").glob("*.parquet"))
    assert len(steps) == 12
    log = pl.read_parquet(steps[0])
    assert {"gpu_audio_tokens", "h2d_bytes", "h2d_transfers"} <= set(log.columns)
    full = table.filter(pl.col("policy") == "full")
    assert (full["attn_recall"] > 1 - 1e-6).all()


def test_bad_arguments_give_clear_errors(tmp_path: Path) -> None:
    make_trace(tmp_path / "t.kvtrace")
    for args, needle in [
        (["-p", "nosuch"], "unknown policy"),
        (["-p", "snapkv:bogus=1"], "no hyperparameter bogus"),
        (["-b", "1.5"], "must be in (0, 1]"),
        (["-b", "abc"], "not a number"),
    ]:
        res = runner.invoke(app, ["replay", str(tmp_path / "t.kvtrace"), *args, "-o", str(tmp_path / "o")])
        assert res.exit_code == 2, res.output
        assert needle in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["replay", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no such file" in res.output


def test_info_synth_policies_mismatch(tmp_path: Path) -> None:
    res = runner.invoke(app, ["synth", str(tmp_path / "s.kvtrace"), "--preset", "tiny", "--audio-seconds", "4",
                              "--decode-steps", "5"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["info", str(tmp_path / "s.kvtrace")])
    assert res.exit_code == 0 and "50 tokens = 4.0 s" in res.output
    res = runner.invoke(app, ["policies"])
    assert res.exit_code == 0 and "snapkv" in res.output and "window = 32" in " ".join(res.output.split())
    res = runner.invoke(app, ["mismatch", str(tmp_path / "s.kvtrace")])
    assert res.exit_code == 0 and "0.479" in res.output
    res = runner.invoke(app, ["synth", str(tmp_path / "x.kvtrace"), "--preset", "nope"])
    assert res.exit_code == 2 and "unknown backbone shape" in res.output


def test_replay_with_simulation(tmp_path: Path) -> None:
    make_trace(tmp_path / "m.kvtrace", preset="minivox", seconds=6, steps=5, seed=1)
    out = tmp_path / "run"
    res = runner.invoke(app, ["replay", str(tmp_path / "m.kvtrace"), "-p", "full,streaming", "-o", str(out),
                              "--simulate", "h100-sxm", "--sim-mode", "sync"])
    assert res.exit_code == 0, res.output
    sim = pl.read_parquet(out / "sim_results.parquet")
    assert sim.height == 2 and set(sim["sim_mode"]) == {"sync"}
    full = sim.filter(pl.col("policy") == "full")
    stream = sim.filter(pl.col("policy") == "streaming")
    # evicting 80% of the audio KV lowers the predicted peak GPU memory
    assert stream["peak_gpu_bytes"][0] < full["peak_gpu_bytes"][0]
    res = runner.invoke(app, ["replay", str(tmp_path / "m.kvtrace"), "-p", "full", "-o", str(out),
                              "--simulate", "nope"])
    assert res.exit_code == 2 and "unknown gpu preset" in res.output


def test_replay_on_ray_matches_local(tmp_path: Path) -> None:
    pytest = __import__("pytest")
    ray = pytest.importorskip("ray")
    make_trace(tmp_path / "tr" / "a.kvtrace", seed=1)
    make_trace(tmp_path / "tr" / "b.kvtrace", seed=2)
    local = runner.invoke(app, ["replay", str(tmp_path / "tr"), "-p", "snapkv", "-o", str(tmp_path / "l")])
    remote = runner.invoke(app, ["replay", str(tmp_path / "tr"), "-p", "snapkv", "-o", str(tmp_path / "r"),
                                 "--ray", "local"])
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    a = pl.read_parquet(tmp_path / "l" / "results.parquet").sort("trace").drop("policy_seconds")
    b = pl.read_parquet(tmp_path / "r" / "results.parquet").sort("trace").drop("policy_seconds")
    assert a.equals(b)
    ray.shutdown()


def test_mismatch_says_when_a_top_k_jaccard_is_trivial() -> None:
    """The shipped synthetic trace has 125 audio tokens: its top-500 Jaccard is 1 by
    construction (the note says so); the 60 s minivox trace (750 tokens) gets no note."""
    from kvsim.specs import default_trace_dir

    traces = default_trace_dir()
    res = runner.invoke(app, ["mismatch", str(traces / "synth-qwen-omni-5s.kvtrace"),
                              str(traces / "minivox-test_30_60-00013.kvtrace")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "synth-qwen-omni-5s: T_a = 125 audio tokens, so its top-500 Jaccard is 1" in text
    assert "minivox-test_30_60-00013: T_a" not in text
