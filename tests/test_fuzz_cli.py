"""Batch commands under bad input: options out of range, unusable ``--out``, bad audio for
``kvsim live`` and ``kvsim trace``, bad traces among good ones for ``kvsim replay``, reruns
into the same ``--out``. Every case must end in one line naming the file (or option) and the
problem, never a traceback; good inputs are still written and the exit code says some failed.
The case counts per class are quoted in docs/reliability.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.rundir import LOCK
from tests.conftest import make_trace
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

runner = CliRunner()


def _one_line(output: str, *needles: str) -> str:
    """The single output line holding every needle (fails when none does), no traceback."""
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if all(n in ln for n in needles)]
    assert lines, f"no line with {needles!r} in:\n{output}"
    return lines[0]


def _manifest(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("traces")
    for i in range(2):
        make_trace(d / f"good{i}.kvtrace", preset="minivox", seconds=6, steps=5, seed=i)
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())


# ----------------------------------------------------------------------------- options
REPLAY_OPTIONS = [
    (["--topk", "0"], "--topk", "[1, inf)"), (["--topk", "-3"], "--topk", "[1, inf)"),
    (["--error-stride", "0"], "--error-stride", "[1, inf)"),
    (["--error-stride", "-1"], "--error-stride", "[1, inf)"),
    (["--max-steps", "0"], "--max-steps", "[1, inf)"), (["--jobs", "0"], "--jobs", "[1, inf)"),
    (["--jobs", "-2"], "--jobs", "[1, inf)"), (["-b", "0"], "budget", "(0, 1]"),
    (["-b", "-0.2"], "budget", "(0, 1]"), (["-b", "1.5"], "budget", "(0, 1]"),
    (["-b", "nan"], "budget", "(0, 1]"),
]
LIVE_OPTIONS = [
    (["--max-new-tokens", "0"], "--max-new-tokens", "[1, inf)"),
    (["--limit", "0"], "--limit", "[1, inf)"), (["--max-seconds", "0"], "--max-seconds", "(0, inf)"),
    (["--max-seconds", "-5"], "--max-seconds", "(0, inf)"),
    (["--max-seconds", "nan"], "--max-seconds", "(0, inf)"), (["-b", "0"], "budget", "(0, 1]"),
]
TRACE_OPTIONS = [
    (["--max-new-tokens", "0"], "--max-new-tokens", "[1, inf)"),
    (["--max-new-tokens", "-1"], "--max-new-tokens", "[1, inf)"),
]
SIMULATE_OPTIONS = [
    (["--batch", "0"], "--batch", "[1, inf)"), (["--retention", "0"], "--retention", "(0, 1]"),
    (["--retention", "1.5"], "--retention", "(0, 1]"),
    (["--tidal-heads", "-1"], "--tidal-heads", "[0, inf)"),
    (["--anchor-heads", "-1"], "--anchor-heads", "[0, inf)"),
    (["--audio-minutes", "0"], "--audio-minutes", "(0, 240]"),
    (["--churn", "-0.5"], "--churn", "[0, inf)"), (["--decode-steps", "0"], "--decode-steps", "[1, 100000]"),
    (["--capacity-gib", "0"], "--capacity-gib", "(0, inf)"),
    (["--audio-minutes", "100000"], "--audio-minutes", "(0, 240]"),
    (["--decode-steps", "1000000000"], "--decode-steps", "[1, 100000]"),
]


def _command(kind: str, tmp_path: Path, traces: Path) -> list[str]:
    out = ["-o", str(tmp_path / "out")]
    return {"replay": ["replay", str(traces), *out],
            "live": ["live", str(tmp_path / "a.wav"), "--model", "tiny", *out],
            "trace": ["trace", str(tmp_path / "a.wav"), "--model", "no-such-model", *out],
            "simulate": ["simulate", "--policy", "snapkv", "--model", "voxtral-mini-3b"]}[kind]


@pytest.mark.parametrize(("kind", "args", "flag", "interval"),
                         [("replay", *c) for c in REPLAY_OPTIONS] + [("live", *c) for c in LIVE_OPTIONS]
                         + [("trace", *c) for c in TRACE_OPTIONS]
                         + [("simulate", *c) for c in SIMULATE_OPTIONS])
def test_option_out_of_range_is_one_line_with_the_range(kind, args, flag, interval, tmp_path, traces):
    res = runner.invoke(app, [*_command(kind, tmp_path, traces), *args])
    assert res.exit_code == 2, res.output
    line = _one_line(res.output, "error:", flag, interval)
    assert "must be in" in line
    assert not (tmp_path / "out" / "run.json").exists()  # rejected before any work


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--topk", "--error-stride", "--max-steps", "--jobs"]),
       value=st.integers(max_value=0))
def test_replay_rejects_every_non_positive_count(flag, value, traces):
    res = runner.invoke(app, ["replay", str(traces), flag, str(value), "-o", "/nonexistent/never-made"])
    assert res.exit_code == 2
    assert _one_line(res.output, "error:", f"option {flag} must be in [1, inf), got {value}")


# ----------------------------------------------------------------------------- --out
def _bad_outs(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "afile").write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / LOCK).write_text(json.dumps({"pid": 1, "host": os.uname().nodename}))  # pid 1 lives
    return {"is a file": tmp_path / "afile", "under a file": tmp_path / "afile" / "sub",
            "unwritable": Path("/proc/kvsim-out"), "locked": locked}


BAD_OUT_NEEDLE = {"is a file": "not a directory", "under a file": "not a directory",
                  "unwritable": "--out", "locked": "in use by kvsim pid 1"}


@pytest.mark.parametrize("case", list(BAD_OUT_NEEDLE))
@pytest.mark.parametrize("kind", ["replay", "live", "trace"])
def test_bad_out_refused_before_work(kind, case, tmp_path, traces, ckpt):
    write_tone(tmp_path / "a.wav", 1.0)
    out = _bad_outs(tmp_path)[case]
    model = str(ckpt) if kind == "trace" else "tiny"
    args = {"replay": ["replay", str(traces), "-p", "full"],
            "live": ["live", str(tmp_path / "a.wav"), "--model", model, "--max-new-tokens", "2"],
            "trace": ["trace", str(tmp_path / "a.wav"), "--model", model, "--max-new-tokens", "2",
                      "--aligner", "none"]}[kind]
    res = runner.invoke(app, [*args, "-o", str(out)])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "error:", "--out", BAD_OUT_NEEDLE[case])
    assert "replaying" not in res.output and "r_GPU" not in res.output  # no work done
    assert not list(tmp_path.rglob("*.kvtrace")) and not list(tmp_path.rglob("results.parquet"))


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, traces):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    res = runner.invoke(app, ["replay", str(traces), "-p", "full", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert _manifest(out)["status"] == "complete" and not (out / LOCK).exists()


# ----------------------------------------------------------------------------- bad audio
def _write_bad(path: Path, kind: str) -> Path:
    x = (0.1 * np.random.default_rng(3).standard_normal(16000)).astype(np.float32)
    if kind == "empty file":
        path.write_bytes(b"")
    elif kind == "header only":
        sf.write(str(path), np.zeros(0, np.float32), 16000)
    elif kind == "nan":
        x[100] = np.nan
        sf.write(str(path), x, 16000, subtype="FLOAT")
    elif kind == "inf":
        x[5] = np.inf
        sf.write(str(path), x, 16000, subtype="FLOAT")
    elif kind == "20 s of zeros":
        sf.write(str(path), np.zeros(20 * 16000, np.float32), 16000)
    elif kind == "garbage":
        path.write_bytes(b"RIFF\x00\x00not really a wave file" * 8)
    return path


BAD_AUDIO = {"empty file": "unreadable audio", "header only": "empty audio", "nan": "NaN or inf",
             "inf": "NaN or inf", "20 s of zeros": "silent audio", "garbage": "unreadable audio"}


@pytest.mark.parametrize("kind", list(BAD_AUDIO))
def test_live_reports_bad_audio_and_runs_the_others(kind, tmp_path):
    good = write_tone(tmp_path / "good.wav", 2.0)
    (tmp_path / "good.txt").write_text("a b c")
    sub = tmp_path / "in ["  # the path reads '[/x]' to rich: must be escaped
    sub.mkdir()
    bad = _write_bad(sub / "x].wav", kind)
    out = tmp_path / "out"
    res = runner.invoke(app, ["live", str(bad), str(good), "--model", "tiny", "-p", "full",
                              "--max-new-tokens", "2", "--no-plot", "-o", str(out)])
    assert res.exit_code == 1, res.output
    _one_line(res.output, str(bad), BAD_AUDIO[kind])
    runs = pl.read_parquet(out / "runs.parquet")
    assert runs["input"].to_list() == ["good"]  # the bad input is never scored
    m = _manifest(out)
    assert m["status"] == "failed" and list(m["completed"]) == ["good"] and list(m["failed"]) == ["x]"]


def test_live_with_only_bad_inputs_writes_no_results(tmp_path):
    bad = _write_bad(tmp_path / "z.wav", "20 s of zeros")
    out = tmp_path / "out"
    res = runner.invoke(app, ["live", str(bad), "--model", "tiny", "--no-plot", "-o", str(out)])
    assert res.exit_code == 1
    _one_line(res.output, "no live run completed")
    assert not (out / "results.parquet").exists() and _manifest(out)["status"] == "failed"


def test_trace_reports_each_bad_audio_and_traces_the_good_one(tmp_path, ckpt):
    d = tmp_path / "in"
    d.mkdir()
    write_tone(d / "good.wav", 1.0)
    bad = {kind: _write_bad(d / f"bad{i}.wav", kind) for i, kind in enumerate(BAD_AUDIO)}
    out = tmp_path / "out"
    res = runner.invoke(app, ["trace", str(d), "--model", str(ckpt), "--max-new-tokens", "2",
                              "--aligner", "none", "-o", str(out)])
    assert res.exit_code == 1, res.output
    for kind, path in bad.items():
        _one_line(res.output, "failed", str(path), BAD_AUDIO[kind])
    assert [p.name for p in out.glob("*.kvtrace")] == ["good.kvtrace"]
    m = _manifest(out)
    assert m["status"] == "failed" and len(m["failed"]) == len(BAD_AUDIO)


# ----------------------------------------------------------------------------- bad traces
def _corrupt(d: Path, kind: str, src: Path) -> Path:
    import shutil

    bad = d / "bad.kvtrace"  # (bracketed trace names are the trace reader's tests)
    shutil.copytree(src, bad)
    if kind == "invalid meta.json":
        (bad / "meta.json").write_text("{")
    elif kind == "truncated tensors":
        with open(bad / "tensors.safetensors", "r+b") as fh:
            fh.truncate(1000)
    return bad


BAD_TRACES = [("invalid meta.json", "1"), ("invalid meta.json", "2"), ("truncated tensors", "1"),
              ("truncated tensors", "2"),
              ("unexpected exception", "1")]  # injected in this process: serial only


@pytest.mark.parametrize(("kind", "jobs"), BAD_TRACES)
def test_replay_bad_trace_among_good_ones(kind, jobs, tmp_path, traces, monkeypatch):
    import shutil

    d = tmp_path / "tr"
    shutil.copytree(traces, d)
    bad = _corrupt(d, kind, traces / "good0.kvtrace")
    if kind == "unexpected exception":
        from kvsim.replay import engine

        real = engine.Replayer.run

        def boom(self, specs):
            if self.trace.path.name.startswith("bad"):
                raise RuntimeError("injected fault")
            return real(self, specs)

        monkeypatch.setattr(engine.Replayer, "run", boom)
    out = tmp_path / "out [/x]"
    res = runner.invoke(app, ["replay", str(d), "-p", "full,streaming", "-o", str(out), "-j", jobs])
    assert res.exit_code == 1, res.output
    _one_line(res.output, "error:", str(bad),
              {"invalid meta.json": "meta.json", "truncated tensors": "tensors.safetensors",
               "unexpected exception": "RuntimeError: injected fault"}[kind])
    table = pl.read_parquet(out / "results.parquet", glob=False)
    assert sorted(set(table["trace"])) == ["good0", "good1"] and table.height == 4
    m = _manifest(out)
    assert m["status"] == "failed" and list(m["failed"]) == [str(bad)]


# ----------------------------------------------------------------------------- reruns
def test_rerun_replaces_the_previous_run_and_simulate_reads_only_it(tmp_path, traces):
    out = tmp_path / "out"
    assert runner.invoke(app, ["replay", str(traces), "-p", "streaming", "-o", str(out)]).exit_code == 0
    res = runner.invoke(app, ["replay", str(traces / "good0.kvtrace"), "-p", "full", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (out / "steps").glob("*.parquet")) == ["good0__full__0.2.parquet"]
    assert pl.read_parquet(out / "results.parquet")["label"].to_list() == ["full"]
    # a stray step log (e.g. copied in by hand) is not part of the run in run.json
    for ext in ("parquet", "json"):
        (out / "steps" / f"stray__streaming__0.2.{ext}").write_bytes(
            (out / "steps" / f"good0__full__0.2.{ext}").read_bytes())
    res = runner.invoke(app, ["simulate", str(out)])
    assert res.exit_code == 0, res.output
    assert "good0__full" in res.output and "stray" not in res.output


def test_resume_keeps_completed_traces_and_refuses_other_options(tmp_path, traces):
    out = tmp_path / "out"
    assert runner.invoke(app, ["replay", str(traces), "-p", "full", "-o", str(out)]).exit_code == 0
    m = _manifest(out)
    first = str(traces / "good0.kvtrace")
    m["completed"].pop(str(traces / "good1.kvtrace"))  # as if killed during good1
    m["status"] = "running"
    (out / "run.json").write_text(json.dumps(m))
    res = runner.invoke(app, ["replay", str(traces), "-p", "full", "-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    assert "good1" in res.output and f"replaying {first}" not in res.output
    assert sorted(pl.read_parquet(out / "results.parquet")["trace"]) == ["good0", "good1"]
    res = runner.invoke(app, ["replay", str(traces), "-p", "snapkv", "-o", str(out), "--resume"])
    assert res.exit_code == 2 and _one_line(res.output, "--resume", "other options")


@pytest.mark.parametrize("own", [["results.parquet", "steps/mine.txt"], ["run.json"], ["steps/mine.txt"]])
def test_replay_refuses_a_folder_that_is_not_a_kvsim_run(own, tmp_path, traces):
    """A folder holding files of the user's own under the names a run manages (no run.json
    written by kvsim) is refused in one line naming it; nothing in it is touched."""
    out = tmp_path / "mine"
    for name in own:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"the user's own {name}")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = runner.invoke(app, ["replay", str(traces), "-p", "full", "-o", str(out)])
    assert res.exit_code == 2, res.output
    line = _one_line(res.output, "error:", "--out", str(out))
    assert "not a kvsim run" in line and len(res.output.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("command", ["simulate-runs", "simulate-table", "fig1", "table7", "alignment"])
def test_out_that_is_a_file_refused_before_work(command, tmp_path, traces):
    """`-o FILE` of the commands that write a folder: one line naming --out, exit 2, before
    any work (the same check as replay's), the file untouched."""
    run = tmp_path / "run"
    assert runner.invoke(app, ["replay", str(traces / "good0.kvtrace"), "-p", "full", "-o", str(run)]).exit_code == 0
    afile = tmp_path / "afile"
    afile.write_text("mine")
    args = {"simulate-runs": ["simulate", str(run)],
            "simulate-table": ["simulate", "--table", "memory"],
            "fig1": ["study", "fig1", str(traces)],
            "table7": ["study", "table7", str(traces), "--no-live", "--quick"],
            "alignment": ["alignment", str(traces)]}[command]
    res = runner.invoke(app, [*args, "-o", str(afile)])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "error:", f"--out {afile}", "not a directory")
    assert len(res.output.strip().splitlines()) == 1, res.output  # no table, no progress
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("step", ["--plot", "--simulate"])
def test_replay_extra_step_failing_leaves_a_truthful_run(step, tmp_path, traces, monkeypatch):
    """While --simulate/--plot run there is no results.parquet and run.json says running; when
    one fails: one line naming it, the replay results kept, status failed, the lock gone."""
    import kvsim.plots
    import kvsim.sim

    out = tmp_path / "out"
    seen = {}

    def boom(*args, **kwargs):
        seen["results"] = (out / "results.parquet").exists()
        seen["status"] = _manifest(out)["status"]
        raise RuntimeError("step exploded")

    monkeypatch.setattr(kvsim.plots if step == "--plot" else kvsim.sim,
                        "save_chart" if step == "--plot" else "simulate_runs", boom)
    extra = ["--plot"] if step == "--plot" else ["--simulate", "h100-sxm", "--sim-mode", "sync"]
    res = runner.invoke(app, ["replay", str(traces), "-p", "full", "-o", str(out), *extra])
    assert res.exit_code == 1, res.output
    assert seen == {"results": False, "status": "running"}
    line = _one_line(res.output, "error:", step, "step exploded")
    assert "RuntimeError" in line
    m = _manifest(out)
    assert m["status"] == "failed" and m["outputs_failed"] == {step: line.removeprefix("error: ")}
    assert not (out / LOCK).exists()
    assert pl.read_parquet(out / "results.parquet").height == 2  # the replay results are kept
    assert not (out / "sim_results.parquet").exists() and not (out / "recall_vs_rgpu.png").exists()


def test_replay_simulate_refuses_a_trace_without_model_preset_before_work(tmp_path, traces):
    tiny = make_trace(tmp_path / "tiny.kvtrace", preset="tiny", seconds=4, steps=3)
    out = tmp_path / "out"
    res = runner.invoke(app, ["replay", str(traces / "good0.kvtrace"), str(tiny), "-p", "full",
                              "-o", str(out), "--simulate", "h100-sxm"])
    assert res.exit_code == 2, res.output
    line = _one_line(res.output, "error:", str(tiny), "--simulate", "'tiny'")
    assert res.output.strip().splitlines() == [line]  # nothing replayed
    assert not out.exists()
