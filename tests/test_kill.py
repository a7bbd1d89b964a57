"""``kill -9`` of ``kvsim replay``, ``kvsim live`` and ``kvsim trace`` once the first input's
result is on disk: nothing half-written may look complete (run.json says ``running``, no
combined table, every kept part readable), and a rerun into the same ``--out`` completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

import kvsim.replay.engine  # noqa: F401  (imported now: the in-process second writer is quick)
from kvsim.cli import app
from kvsim.rundir import LOCK
from kvsim.trace.validate import validate_trace
from tests.conftest import make_trace
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _kill_after(args: list[str], out: Path, first_done: Callable[[], bool],
                meanwhile: Callable[[], None] = lambda: None) -> None:
    """Start ``python -m kvsim ARGS``; once it has written run.json run ``meanwhile()`` with it
    stopped (SIGSTOP: a fast run could otherwise end, and free its --out, before ``meanwhile``
    looks); wait until ``first_done()``, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = out.with_name(f"{out.name}.stderr")  # a file, not a pipe: a full pipe would block it
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvsim", *args, "-o", str(out)], env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 150
    started = False
    try:
        while not first_done():
            if not started and (out / "run.json").exists():
                started = True
                proc.send_signal(signal.SIGSTOP)  # alive but still: it cannot finish meanwhile
                try:
                    meanwhile()
                finally:
                    proc.send_signal(signal.SIGCONT)
            if proc.poll() is not None:
                pytest.fail(f"exited ({proc.returncode}) before its first result: "
                            f"{log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no first result within 150 s")
            time.sleep(0.01)
        assert proc.poll() is None, "finished before the kill: give it more inputs"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()


def _first_completed(out: Path) -> Callable[[], bool]:
    """True once run.json records a completed input."""
    def done() -> bool:
        try:
            return bool(json.loads((out / "run.json").read_text())["completed"])
        except (OSError, ValueError, KeyError):
            return False
    return done


def _assert_nothing_half_written_looks_complete(out: Path) -> dict:
    m = json.loads((out / "run.json").read_text())
    assert m["status"] == "running"
    assert 1 <= len(m["completed"]) < len(m["inputs"])
    assert not (out / "results.parquet").exists()  # written only once every input is done
    for entry in m["completed"].values():  # every kept part is whole (a part written just
        assert pl.read_parquet(out / entry["part"]).height > 0  # before the kill is not listed)
    assert (out / LOCK).exists()  # left by the dead process; the rerun takes it over
    return m


def test_kill_replay_then_resume(tmp_path):
    d = tmp_path / "tr"
    for i in range(12):
        make_trace(d / f"t{i}.kvtrace", preset="small", seconds=20, steps=40, seed=i)
    out = tmp_path / "out"
    args = ["replay", str(d), "-p", "full,snapkv,streaming", "-b", "0.3"]

    def second_writer_refused() -> None:
        res = runner.invoke(app, [*args, "-o", str(out)])
        assert res.exit_code == 2 and "in use by kvsim pid" in res.output, res.output

    _kill_after(args, out, _first_completed(out), second_writer_refused)
    killed = _assert_nothing_half_written_looks_complete(out)
    res = runner.invoke(app, [*args, "-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    for path in killed["completed"]:
        assert f"replaying {path} " not in res.output  # kept, not redone
    table = pl.read_parquet(out / "results.parquet")
    assert sorted(set(table["trace"])) == sorted(f"t{i}" for i in range(12)) and table.height == 12 * 3
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
    assert len(list((out / "steps").glob("*.parquet"))) == 12 * 3


def test_kill_live_then_resume(tmp_path):
    for i in range(3):
        write_tone(tmp_path / f"c{i}.wav", 3.0, seed=i)
        (tmp_path / f"c{i}.txt").write_text("some words")
    out = tmp_path / "out"
    args = ["live", *(str(tmp_path / f"c{i}.wav") for i in range(3)), "--model", "tiny",
            "-p", "full,snapkv", "-b", "0.3", "--max-new-tokens", "32", "--no-plot"]
    _kill_after(args, out, _first_completed(out))
    killed = _assert_nothing_half_written_looks_complete(out)
    res = runner.invoke(app, [*args, "-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    runs = pl.read_parquet(out / "runs.parquet")
    assert sorted(set(runs["input"])) == [f"c{i}" for i in range(3)] and runs.height == 3 * 2
    assert set(killed["completed"]) < set(runs["input"])
    assert json.loads((out / "run.json").read_text())["status"] == "complete"


def test_kill_trace_then_rerun(tmp_path):
    ckpt = tiny_checkpoint("voxtral", tmp_path)
    inputs = [write_tone(tmp_path / f"a{i}.wav", 1.5, seed=i) for i in range(4)]
    out = tmp_path / "out"

    args = ["trace", *map(str, inputs), "--model", str(ckpt), "--max-new-tokens", "16",
            "--aligner", "none"]
    _kill_after(args, out, _first_completed(out))
    m = json.loads((out / "run.json").read_text())
    assert m["status"] == "running" and 1 <= len(m["completed"]) < len(inputs)
    for p in out.glob("*.kvtrace"):  # a trace directory exists only once whole
        validate_trace(p)
    res = runner.invoke(app, [*args, "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "already complete" in res.output
    assert sorted(p.name for p in out.glob("*.kvtrace")) == [f"a{i}.kvtrace" for i in range(4)]
    assert not list(out.glob("*.tmp-*"))
    assert json.loads((out / "run.json").read_text())["status"] == "complete"
