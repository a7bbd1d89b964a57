"""Trace format v1: round trip, lazy reads, size, and every corruption named by file + field."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, TraceError, write_trace
from kvsim.trace.schema import TRACE_SUFFIX
from kvsim.trace.validate import validate_trace
from tests.conftest import make_trace

runner = CliRunner()


def test_round_trip_is_exact(tmp_path: Path) -> None:
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=6, decode_steps=9, seed=1))
    t = Trace(write_trace(tmp_path / "rt.kvtrace", data))
    assert t.meta.n_positions == data.keys.shape[2]
    for layer in range(t.meta.model.n_layers):
        np.testing.assert_array_equal(t.keys(layer), data.keys[layer].astype(np.float16))
        np.testing.assert_array_equal(t.queries(layer), data.queries[layer].astype(np.float16))
        np.testing.assert_array_equal(t.values(layer), data.values[layer].astype(np.float16))
    np.testing.assert_array_equal(t.query_positions, data.query_positions)
    assert t.positions.equals(data.positions)
    np.testing.assert_array_equal(t.head_scores.voice_score, data.head_scores.voice_score)  # JSON round trip of float64: exact
    assert t.n_audio == int((data.positions["kind"] == "audio").sum())
    # the observation window is the last 32 prompt positions (WnW App. F), audio included here
    np.testing.assert_array_equal(t.window_positions, np.arange(t.meta.n_prefill - 32, t.meta.n_prefill))
    assert t.window_positions[0] < t.audio_positions[-1]


def test_reads_are_memory_mapped(small_trace: Trace) -> None:
    k = small_trace.keys(0)
    assert isinstance(k.base, np.memmap) or isinstance(k, np.memmap)
    assert not k.flags.writeable


def test_size_overhead_within_5_percent(small_trace: Trace) -> None:
    assert small_trace.disk_bytes() <= 1.05 * small_trace.tensor_bytes()


def test_synthesis_is_reproducible() -> None:
    a = synthesize(SynthConfig(preset="tiny", audio_seconds=5, decode_steps=5, seed=7))
    b = synthesize(SynthConfig(preset="tiny", audio_seconds=5, decode_steps=5, seed=7))
    c = synthesize(SynthConfig(preset="tiny", audio_seconds=5, decode_steps=5, seed=8))
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.queries, b.queries)
    assert not np.array_equal(a.keys, c.keys)


# ----------------------------------------------------------------------------- corruption
def _corrupt_truncate(p: Path) -> tuple[str, str]:
    f = p / "tensors.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    return "tensors.safetensors", "<file>"


def _corrupt_missing(p: Path) -> tuple[str, str]:
    (p / "positions.parquet").unlink()
    return "positions.parquet", "<file>"


def _corrupt_version(p: Path) -> tuple[str, str]:
    meta = json.loads((p / "meta.json").read_text())
    meta["schema_version"] = 99
    (p / "meta.json").write_text(json.dumps(meta))
    return "meta.json", "schema_version"


def _corrupt_shape(p: Path) -> tuple[str, str]:
    meta = json.loads((p / "meta.json").read_text())
    meta["model"]["n_kv_heads"] = 1
    meta["model"]["n_q_heads"] = 4
    (p / "meta.json").write_text(json.dumps(meta))
    return "tensors.safetensors", "keys"


def _corrupt_nan(p: Path) -> tuple[str, str]:
    t = Trace(p)
    offset = t._tensors["keys"].begin + 2 * 100
    f = p / "tensors.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.array([np.nan], dtype=np.float16).tobytes())
    # keep the manifest checksum consistent so the NaN scan (not the checksum) must catch it
    import hashlib

    meta = json.loads((p / "meta.json").read_text())
    meta["files"]["tensors.safetensors"]["sha256"] = hashlib.sha256(f.read_bytes()).hexdigest()
    (p / "meta.json").write_text(json.dumps(meta))
    return "tensors.safetensors", "keys"


def _corrupt_parquet(p: Path) -> tuple[str, str]:
    f = p / "positions.parquet"
    size = f.stat().st_size
    f.write_bytes(b"garbage!" * (size // 8) + b"x" * (size % 8))
    meta = json.loads((p / "meta.json").read_text())
    meta["files"]["positions.parquet"]["sha256"] = None  # only the parquet reader can catch it
    (p / "meta.json").write_text(json.dumps(meta))
    return "positions.parquet", "<parquet>"


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_truncate, _corrupt_missing, _corrupt_version, _corrupt_shape, _corrupt_nan, _corrupt_parquet],
    ids=["truncated", "missing-file", "schema-version", "shape-mismatch", "nan-keys", "garbage-parquet"],
)
def test_corrupt_trace_gives_one_line_error_naming_file_and_field(tmp_path: Path, corrupt) -> None:
    good = make_trace(tmp_path / "good.kvtrace", seed=2)
    bad = tmp_path / "bad.kvtrace"
    shutil.copytree(good, bad)
    file, field = corrupt(bad)
    with pytest.raises(TraceError) as info:
        validate_trace(bad)
    msg = str(info.value)
    assert "\n" not in msg
    assert file in msg and f": {field}:" in msg
    # the CLI reports the same line, validates the good one, and exits non-zero
    res = runner.invoke(app, ["validate", str(good), str(bad)])
    assert res.exit_code == 1
    assert "Traceback" not in res.output
    assert f"ok     {good}" in res.output and "BROKEN" in res.output and field in res.output


def test_replay_reports_broken_trace_and_completes_others(tmp_path: Path) -> None:
    good = make_trace(tmp_path / "set" / "good.kvtrace", seed=4)
    bad = tmp_path / "set" / "bad.kvtrace"
    shutil.copytree(good, bad)
    _corrupt_truncate(bad)
    res = runner.invoke(app, ["replay", str(tmp_path / "set"), "-p", "full", "-o", str(tmp_path / "out")])
    assert res.exit_code == 1
    assert "bad.kvtrace" in res.output and "Traceback" not in res.output
    import polars as pl

    table = pl.read_parquet(tmp_path / "out" / "results.parquet")
    assert table["trace"].to_list() == ["good"]


# ----------------------------------------------------------------------------- atomicity
WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import kvsim.trace.writer as w
    from kvsim.synth import SynthConfig, synthesize
    data = synthesize(SynthConfig(preset="small", audio_seconds=20, decode_steps=20, seed=0))
    orig = w.TraceWriter.write_layer
    def slow_layer(self, layer, *a, **k):
        orig(self, layer, *a, **k)
        if layer == 1:
            print("WRITING", flush=True)
            time.sleep(30)  # killed here, mid-write: layers 0 and 1 of 4 written
    w.TraceWriter.write_layer = slow_layer if sys.argv[2] == "slow" else orig
    w.write_trace(sys.argv[1], data)
    print("DONE", flush=True)
""")


def test_killed_writer_leaves_nothing_valid_and_rerun_completes(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    target = tmp_path / "out" / "t.kvtrace"
    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, str(script), str(target), "slow"], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "WRITING"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not target.exists()
    leftovers = list((tmp_path / "out").iterdir())
    assert leftovers, "the interrupted write should leave its temporary directory"
    for p in leftovers:
        with pytest.raises(TraceError):
            validate_trace(p)
    res = runner.invoke(app, ["validate", str(tmp_path / "out")])
    # the leftover is no trace: the folder holds none, a wrong call (exit 2, as replay's)
    assert res.exit_code == 2 and f"contains no *{TRACE_SUFFIX}" in res.output
    assert runner.invoke(app, ["replay", str(tmp_path / "out"), "-p", "full",
                               "-o", str(tmp_path / "runs")]).exit_code == 2
    # a rerun completes and yields a valid trace
    t0 = time.time()
    done = subprocess.run([sys.executable, str(script), str(target), "fast"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert validate_trace(target).meta.n_decode == 20
    assert time.time() - t0 < 120


# ----------------------------------------------------------------------------- errors
def test_error_stays_one_line_and_survives_a_process_pool(tmp_path: Path) -> None:
    import pickle

    p = tmp_path / "a\nb.kvtrace"
    p.mkdir()
    with pytest.raises(TraceError) as info:
        Trace(p)
    err = info.value
    assert "\n" not in str(err) and "a\\nb.kvtrace" in str(err) and err.field == "<file>"
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, TraceError) and str(again) == str(err) and again.field == err.field


def test_unstored_query_position_is_a_trace_error(small_trace: Trace) -> None:
    for position in (-1, small_trace.meta.n_positions, int(small_trace.audio_positions[0])):
        with pytest.raises(TraceError, match=r": query_positions: no query stored for position"):
            small_trace.query_index(position)
    assert small_trace.query_index(small_trace.meta.n_prefill) >= 0


def test_info_prints_every_trace(tmp_path: Path) -> None:
    a = make_trace(tmp_path / "a.kvtrace", seed=1)
    b = make_trace(tmp_path / "b.kvtrace", seed=2, steps=7)
    res = runner.invoke(app, ["info", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "/ 12 steps" in res.output and "/ 7 steps" in res.output  # a's and b's decode rows


def test_calibration_file_that_could_block_is_refused(tmp_path: Path) -> None:
    import os

    from kvsim.trace.heads import read_heads

    os.mkfifo(tmp_path / "heads.json")
    for path, needle in [(tmp_path / "heads.json", "a FIFO"), (Path("/dev/zero"), "character device"),
                         (tmp_path / "none.json", "missing")]:
        with pytest.raises(TraceError, match=needle):
            read_heads(path)
