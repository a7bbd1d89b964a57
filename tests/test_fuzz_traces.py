"""Fuzz suite for trace inputs: corrupt traces of every class, and what each command does.

Every case builds a broken copy of one small synthetic trace and asserts, for the commands
that read it (``validate`` always; ``info``, ``replay``, ``mismatch`` or ``alignment``): a
non-zero exit, exactly one error line for the bad trace, equal to the :class:`TraceError`
that names its file and field, no "Traceback", and for ``replay`` no result rows for the bad
trace. Where a command may legitimately not see a corruption (a flipped data byte passes the
cheap checks on open, only ``validate``'s checksum sees it), the weaker property is stated.

Hostile manifests (FIFO, ``/dev/zero``, links out) also run end to end in subprocesses with a
timeout: no hang, no traceback, outside the test runner too.

Counting: every case that passes is counted per class. Run
``KVSIM_FUZZ_REPORT=docs/reliability.md pytest tests/test_fuzz_traces.py`` to rewrite the
table between the ``fuzz-counts`` markers of that file (any other path gets the bare table).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.trace import Trace, TraceError, write_trace
from kvsim.trace.validate import validate_trace
from tests.conftest import make_trace

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
MEMBERS = ("tensors.safetensors", "positions.parquet", "heads.json")
FILES = ("meta.json", *MEMBERS)
TENSORS = ("keys", "queries", "query_positions", "values")

#: class -> what it covers; COUNTS[class] -> cases that passed
CLASSES = {
    "byte-flip": "random byte flips of each file",
    "truncation": "random truncations of each file",
    "meta-json": "meta.json values of wrong JSON type or range; wrong root, model, files shapes",
    "safetensors-header": "header entries mistyped, missing, out of bounds, overlapping, unknown",
    "manifest": "names with separators, '..', absolute, /dev/zero, unknown; links out, FIFOs, "
                "directories, dangling links, loops as member files",
    "non-finite": "NaN/+inf/-inf in keys, queries or values (checksums kept consistent)",
    "query-positions": "negative, out-of-range, unsorted, duplicate or missing query positions",
    "dtype": "unknown model.dtype, unknown or mismatched tensor dtypes",
    "positions-table": "positions.parquet columns missing, mistyped, null, out of range, inconsistent",
    "heads-json": "heads.json of the wrong format, shape, NaN, negative values",
    "directory": "missing path, file or FIFO for a trace, interrupted write, folder without traces",
    "names": "trace names, paths and texts holding [brackets], rich markup, emoji codes",
}
COUNTS: Counter[str] = Counter()
FUZZ = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.sampled_from(["", "[/x]", "float16", "F16", "../x", ":smile:"]) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)


# ----------------------------------------------------------------------------- building cases
@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny synthetic trace with values and head scores; every case corrupts a copy."""
    yield make_trace(tmp_path_factory.mktemp("good") / "good.kvtrace", seconds=4, steps=5, seed=5)
    _write_report()


@contextlib.contextmanager
def broken_copy(good: Path, name: str = "bad.kvtrace") -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        shutil.copytree(good, p)
        yield p


def refresh(p: Path, name: str) -> None:
    """Record the member's current size and SHA-256, so that only the check under test sees
    the corruption (not the size or checksum)."""
    meta = json.loads((p / "meta.json").read_text())
    data = (p / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (p / "meta.json").write_text(json.dumps(meta))


def edit_meta(p: Path, edit: Callable[[dict], Any]) -> None:
    meta = json.loads((p / "meta.json").read_text())
    edit(meta)
    (p / "meta.json").write_text(json.dumps(meta))


def read_header(p: Path) -> tuple[dict, bytes]:
    raw = (p / "tensors.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), raw[8 + n:]


def write_header(p: Path, header: Any, data: bytes) -> None:
    text = json.dumps(header).encode()
    (p / "tensors.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
    refresh(p, "tensors.safetensors")


def edit_tensors(p: Path, edit: Callable[[dict[str, np.ndarray]], Any]) -> None:
    arrays = load_file(str(p / "tensors.safetensors"))
    edit(arrays)
    save_file(arrays, str(p / "tensors.safetensors"))
    refresh(p, "tensors.safetensors")


def edit_positions(p: Path, edit: Callable[[pl.DataFrame], pl.DataFrame]) -> None:
    edit(pl.read_parquet(p / "positions.parquet")).write_parquet(p / "positions.parquet")
    refresh(p, "positions.parquet")


# ----------------------------------------------------------------------------- assertions
Field = str | tuple[str, ...] | Callable[[str], bool] | None


def assert_names(exc: TraceError, p: Path, file: str | None, field: Field) -> None:
    """``exc`` is one line naming a file of trace ``p`` (``file`` when given) and ``field``."""
    text = str(exc)
    assert "\n" not in text and text == f"{exc.file}: {exc.field}: {exc.message}"
    assert exc.file.startswith(str(p)), text
    if file is not None:
        assert exc.file == str(p / file) if file else exc.file == str(p), text
    assert exc.field, text
    if isinstance(field, str):
        assert exc.field == field, text
    elif isinstance(field, tuple):
        assert exc.field in field, text
    elif field is not None:
        assert field(exc.field), text


def error_lines(res: Any, label: str) -> list[str]:
    assert "Traceback" not in res.output, res.output
    return [line for line in res.stderr.splitlines() if line.startswith(label)]


def cli_rejects(args: list[str], exc: TraceError | str, label: str = "error:") -> Any:
    """The command exits 1 and prints exactly one error line: ``label`` + the error."""
    res = runner.invoke(app, args)
    assert res.exit_code == 1, (res.exit_code, res.output)
    assert error_lines(res, label) == [f"{label} {exc}"], res.output
    return res


def rejected(fn: Callable[[], Any]) -> TraceError | None:
    try:
        fn()
    except TraceError as exc:
        return exc
    return None


def replay_rejects(p: Path, exc: TraceError) -> None:
    """Replay exits non-zero, prints the error line, and writes no result for the trace."""
    out = p.parent / "replay-out"
    cli_rejects(["replay", str(p), "-p", "full", "-o", str(out)], exc)
    results = out / "results.parquet"
    assert not results.exists() or p.name.removesuffix(".kvtrace") not in pl.read_parquet(results)["trace"]


def command_rejects(cmd: str, p: Path, exc: TraceError) -> None:
    if cmd == "replay":
        replay_rejects(p, exc)
    else:
        cli_rejects([cmd, str(p)], exc)


def expect_rejected_on_open(p: Path, file: str | None, field: Field, cmds: tuple[str, ...] = ("info", "replay")) -> TraceError:
    """Opening fails: validate and every command in ``cmds`` print the same one line."""
    exc = rejected(lambda: Trace(p))
    assert exc is not None, f"{p} opened"
    assert_names(exc, p, file, field)
    assert str(rejected(lambda: validate_trace(p))) == str(exc)
    cli_rejects(["validate", str(p)], exc, "BROKEN")
    for cmd in cmds:
        command_rejects(cmd, p, exc)
    return exc


def one_command(case: str) -> str:
    """info or replay for a listed case (alternating by name: both are covered, each case
    costs one command run; the checks on open they share are asserted for every case)."""
    return ("info", "replay")[zlib.crc32(case.encode()) % 2]


def count(cls: str) -> None:
    assert cls in CLASSES
    COUNTS[cls] += 1


def _write_report() -> None:
    target = os.environ.get("KVSIM_FUZZ_REPORT")
    if not target or not COUNTS:
        return
    rows = ["| class | cases | what |", "|---|---:|---|"]
    rows += [f"| {cls} | {COUNTS[cls]} | {what} |" for cls, what in CLASSES.items()]
    rows.append(f"| **total** | **{sum(COUNTS.values())}** | all handled (the suite passed) |")
    table = "\n".join(rows)
    path = Path(target)
    text = path.read_text() if path.exists() else ""
    begin, end = "<!-- fuzz-counts:begin -->", "<!-- fuzz-counts:end -->"
    if begin in text and end in text:
        text = re.sub(f"{begin}.*?{end}", f"{begin}\n{table}\n{end}", text, flags=re.S)
    else:
        text = table + "\n"
    path.write_text(text)


# ----------------------------------------------------------------------------- random damage
@FUZZ
@given(name=st.sampled_from(FILES), where=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255),
       cmd=st.sampled_from(["info", "replay"]))
def test_byte_flip(good: Path, name: str, where: float, xor: int, cmd: str) -> None:
    """A flipped byte in a member file is always caught by validate (structure or SHA-256),
    naming that file. In meta.json it may land in free text and pass; otherwise it is named.
    info/replay either accept the trace (their cheap checks pass) or print the open error."""
    with broken_copy(good) as p:
        f = p / name
        data = bytearray(f.read_bytes())
        data[int(where * len(data))] ^= xor
        f.write_bytes(bytes(data))
        exc = rejected(lambda: validate_trace(p))
        if name != "meta.json":
            assert exc is not None
            assert_names(exc, p, name, None)
        if exc is None:
            assert runner.invoke(app, ["validate", str(p)]).exit_code == 0
        else:
            assert_names(exc, p, None, None)
            cli_rejects(["validate", str(p)], exc, "BROKEN")
        open_exc = rejected(lambda: Trace(p))
        if open_exc is not None:
            command_rejects(cmd, p, open_exc)
        else:
            res = runner.invoke(app, [cmd, str(p), "-p", "full", "-o", str(p.parent / "o")]
                                if cmd == "replay" else [cmd, str(p)])
            lines = error_lines(res, "error:")
            assert (res.exit_code, lines) == (0, []) or (res.exit_code == 1 and len(lines) == 1
                                                         and str(p) in lines[0]), res.output
    count("byte-flip")


@FUZZ
@given(name=st.sampled_from(FILES), keep=st.floats(0, 1, exclude_max=True), cmd=st.sampled_from(["info", "replay"]))
def test_truncation(good: Path, name: str, keep: float, cmd: str) -> None:
    """A truncated file fails on open: meta.json as invalid JSON, a member by its size."""
    with broken_copy(good) as p:
        f = p / name
        data = f.read_bytes()
        f.write_bytes(data[: int(keep * len(data))])
        expect_rejected_on_open(p, name, "<json>" if name == "meta.json" else "<file>", (cmd,))
    count("truncation")


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_dict(v: Any, nullable: bool = False) -> bool:
    return isinstance(v, dict) or (nullable and v is None)


META_KEYS: dict[tuple[str, ...], Callable[[Any], bool]] = {  # key path -> right JSON type?
    ("schema",): lambda v: v == "kvsim.trace", ("schema_version",): lambda v: v == 1 and _is_int(v),
    ("model",): _is_dict, ("model", "name"): _is_str, ("model", "dtype"): _is_str,
    **{("model", k): _is_int for k in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim")},
    ("model", "audio_tokens_per_s"): lambda v: type(v) in (int, float),
    **{(k,): _is_int for k in ("n_positions", "n_prefill", "n_decode")},
    ("prompt",): _is_str, ("generated_text",): _is_str,
    ("reference_text",): lambda v: v is None or _is_str(v),
    ("has_values",): lambda v: isinstance(v, bool), ("has_head_scores",): lambda v: isinstance(v, bool),
    **{(k,): lambda v: _is_dict(v, nullable=True) for k in ("input_transform", "audio", "provenance")},
    ("files",): _is_dict,
    **{("files", m): _is_dict for m in MEMBERS},
    **{("files", m, "bytes"): _is_int for m in MEMBERS},
    **{("files", m, "sha256"): lambda v: v is None or _is_str(v) for m in MEMBERS},
}


@FUZZ
@given(key=st.sampled_from(sorted(META_KEYS)), value=JSON, cmd=st.sampled_from(["info", "replay"]))
def test_meta_json_values(good: Path, key: tuple[str, ...], value: Any, cmd: str) -> None:
    """Any JSON value in any meta.json field: a value of the wrong type is named by its
    field; a value of the right type is accepted or named cleanly (by a range or consistency
    check); either way validate, info and replay agree and never trace back."""
    with broken_copy(good) as p:
        def put(meta: dict) -> None:
            for part in key[:-1]:
                meta = meta[part]
            meta[key[-1]] = value

        edit_meta(p, put)
        exc = rejected(lambda: Trace(p))
        if not META_KEYS[key](value):
            assert exc is not None and exc.field == ".".join(key), (key, value, exc)
        if exc is None:
            assert runner.invoke(app, ["info", str(p)]).exit_code == 0
        else:
            expect_rejected_on_open(p, None, None, (cmd,))
    count("meta-json")


@pytest.mark.parametrize("root", [[], "x", 3, None, {"schema": "kvsim.trace"}])
def test_meta_json_root(good: Path, root: Any) -> None:
    with broken_copy(good) as p:
        (p / "meta.json").write_text(json.dumps(root))
        expect_rejected_on_open(p, "meta.json", ("<root>", "schema", "schema_version"))
    count("meta-json")


@FUZZ
@given(tensor=st.sampled_from(TENSORS), attr=st.sampled_from(["dtype", "shape", "data_offsets", None]),
       value=JSON | st.just("<delete>"), cmd=st.sampled_from(["info", "replay"]))
def test_safetensors_header_entries(good: Path, tensor: str, attr: str | None, value: Any, cmd: str) -> None:
    """Any JSON value for a header entry or one of its fields (or the field deleted) is named
    by the tensor and field (or by the layout it breaks), with sizes and checksums kept."""
    with broken_copy(good) as p:
        header, data = read_header(p)
        entry = header[tensor]
        before = json.dumps(header, sort_keys=True)
        if attr is None:
            header[tensor] = value
        elif value == "<delete>":
            del entry[attr]
        else:
            entry[attr] = value
        assume(json.dumps(header, sort_keys=True) != before)
        write_header(p, header, data)
        expect_rejected_on_open(p, "tensors.safetensors",
                                lambda f: f == "<header>" or f.split(".")[0] in TENSORS, (cmd,))
    count("safetensors-header")


@pytest.mark.parametrize("case", ["root-list", "unknown-tensor", "metadata", "huge-length", "overlap", "gap",
                                  "not-json", "short"])
def test_safetensors_header_layout(good: Path, case: str) -> None:
    with broken_copy(good) as p:
        header, data = read_header(p)
        if case == "root-list":
            write_header(p, [header], data)
        elif case == "unknown-tensor":
            write_header(p, {**header, "extra": {"dtype": "F16", "shape": [0], "data_offsets": [0, 0]}}, data)
        elif case == "metadata":
            write_header(p, {**header, "__metadata__": {"format": 3}}, data)
        elif case == "overlap":  # keys read the bytes of queries: same size, other data
            header["keys"]["data_offsets"] = list(header["queries"]["data_offsets"])
            write_header(p, header, data)
        elif case == "gap":
            write_header(p, header, data + b"\0" * 8)
        else:
            raw = {"huge-length": struct.pack("<Q", 2**63) + b"{}", "not-json": struct.pack("<Q", 4) + b"{{{{",
                   "short": b"\1\2"}[case]
            (p / "tensors.safetensors").write_bytes(raw)
            refresh(p, "tensors.safetensors")
        expect_rejected_on_open(p, "tensors.safetensors",
                                lambda f: f in ("<header>", "__metadata__") or f.split(".")[0] in (*TENSORS, "extra"),
                                (one_command(case),))
    count("safetensors-header")


# ----------------------------------------------------------------------------- hostile manifests
def _link_out(p: Path, name: str) -> None:
    outside = p.parent / f"outside-{name}"
    shutil.copy(p / name, outside)
    (p / name).unlink()
    (p / name).symlink_to(outside)


def _replace(p: Path, name: str, make: Callable[[Path], Any]) -> None:
    (p / name).unlink()
    make(p / name)


def _add_entry(name: str) -> Callable[[Path], None]:
    return lambda p: edit_meta(p, lambda m: m["files"].update({name: {"bytes": 0, "sha256": None}}))


HOSTILE: dict[str, tuple[Callable[[Path], Any], str, str]] = {  # case -> (damage, file, field)
    "dotdot": (_add_entry("../good.kvtrace"), "meta.json", "files.../good.kvtrace"),
    "absolute": (_add_entry("/etc/passwd"), "meta.json", "files./etc/passwd"),
    "dev-zero": (_add_entry("/dev/zero"), "meta.json", "files./dev/zero"),
    "subdir": (_add_entry("sub/tensors.safetensors"), "meta.json", "files.sub/tensors.safetensors"),
    "empty-name": (_add_entry(""), "meta.json", "files."),
    "dot": (_add_entry("."), "meta.json", "files.."),
    "backslash": (_add_entry("a\\b"), "meta.json", "files.a\\b"),
    "nul": (_add_entry("x\0y"), "meta.json", "files.x\\x00y"),
    "unknown-name": (_add_entry("notes.txt"), "meta.json", "files.notes.txt"),
    "link-out": (lambda p: _link_out(p, "tensors.safetensors"), "tensors.safetensors", "<file>"),
    "link-dev-zero": (lambda p: _replace(p, "heads.json", lambda f: f.symlink_to("/dev/zero")), "heads.json", "<file>"),
    "fifo": (lambda p: _replace(p, "positions.parquet", os.mkfifo), "positions.parquet", "<file>"),
    "link-to-fifo": (lambda p: (os.mkfifo(p / "pipe"), _replace(p, "heads.json", lambda f: f.symlink_to("pipe"))),
                     "heads.json", "<file>"),
    "meta-fifo": (lambda p: _replace(p, "meta.json", os.mkfifo), "meta.json", "<file>"),
    "meta-link-out": (lambda p: _replace(p, "meta.json", lambda f: f.symlink_to("/dev/zero")), "meta.json", "<file>"),
    "directory": (lambda p: _replace(p, "positions.parquet", Path.mkdir), "positions.parquet", "<file>"),
    "dangling-link": (lambda p: _replace(p, "heads.json", lambda f: f.symlink_to("nowhere")), "heads.json", "<file>"),
    "link-loop": (lambda p: _replace(p, "heads.json", lambda f: f.symlink_to("heads.json")), "heads.json", "<file>"),
    "huge-size": (lambda p: edit_meta(p, lambda m: m["files"]["tensors.safetensors"].update(bytes=2**62)),
                  "tensors.safetensors", "<file>"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest(good: Path, case: str) -> None:
    """Nothing outside the trace, nothing but a regular file, is ever opened or read."""
    damage, file, field = HOSTILE[case]
    with broken_copy(good) as p:
        damage(p)
        t0 = time.perf_counter()
        expect_rejected_on_open(p, file, field)
        assert time.perf_counter() - t0 < 30
    count("manifest")


def test_hostile_traces_end_to_end_in_subprocesses(good: Path, tmp_path: Path) -> None:
    """The real command line, one process per command over all hostile traces and a good one:
    each bad trace is exactly one line naming it, the good one is processed, no hang."""
    cases = ["dev-zero", "dotdot", "fifo", "meta-fifo", "link-dev-zero", "link-out"]
    bad = []
    for case in cases:
        p = tmp_path / f"{case}.kvtrace"
        shutil.copytree(good, p)
        HOSTILE[case][0](p)
        bad.append(p)
    shutil.copytree(good, tmp_path / "fine.kvtrace")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for cmd in (["validate"], ["info"], ["replay", "-p", "full", "-o", str(tmp_path / "out")]):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "kvsim", cmd[0], *map(str, sorted(tmp_path.glob("*.kvtrace"))),
                              *cmd[1:]], capture_output=True, text=True, env=env, timeout=120)
        assert time.perf_counter() - t0 < 60
        assert res.returncode == 1 and "Traceback" not in res.stderr + res.stdout, res.stderr
        lines = [x for x in res.stderr.splitlines() if x.startswith(("error:", "BROKEN"))]
        assert sorted(lines) == sorted(f"{lines[0].split()[0]} {rejected(lambda p=p: Trace(p))}" for p in bad)
    assert pl.read_parquet(tmp_path / "out" / "results.parquet")["trace"].to_list() == ["fine"]
    count("manifest")


# ----------------------------------------------------------------------------- tensor contents
@FUZZ
@given(tensor=st.sampled_from(["keys", "queries", "values"]), where=st.floats(0, 1, exclude_max=True),
       value=st.sampled_from([np.nan, np.inf, -np.inf]), cmd=st.sampled_from(["replay", "mismatch", "alignment"]))
def test_non_finite_tensors(good: Path, tensor: str, where: float, value: float, cmd: str) -> None:
    """NaN/inf never yields a figure: validate names the tensor, layer and index; replay (and
    mismatch/alignment, which read keys and queries) refuse the trace with the same line."""
    with broken_copy(good) as p:
        spec = Trace(p)._tensors[tensor]
        n = int(np.prod(spec.shape))
        with open(p / "tensors.safetensors", "r+b") as fh:
            fh.seek(spec.begin + 2 * int(where * n))
            fh.write(np.array([value], dtype=np.float16).tobytes())
        refresh(p, "tensors.safetensors")
        Trace(p)  # the cheap checks on open do not scan the tensors
        exc = rejected(lambda: validate_trace(p))
        assert exc is not None
        assert_names(exc, p, "tensors.safetensors", tensor)
        assert "non-finite" in exc.message
        cli_rejects(["validate", str(p)], exc, "BROKEN")
        assert runner.invoke(app, ["info", str(p)]).exit_code == 0
        if cmd == "replay" or tensor != "values":
            command_rejects(cmd, p, exc)
    count("non-finite")


@FUZZ
@given(mode=st.sampled_from(["set", "swap", "dup"]), i=st.integers(0, 10 ** 6), value=st.integers(-(10 ** 6), 10 ** 6)
       | st.sampled_from([-1, 0, 10 ** 18]), cmd=st.sampled_from(["info", "replay", "mismatch"]))
def test_query_positions(good: Path, mode: str, i: int, value: int, cmd: str) -> None:
    """Any change of the stored query positions is an error on open naming query_positions
    (range, order, answer queries) or the positions table's query_index that disagrees."""
    with broken_copy(good) as p:
        def damage(arrays: dict[str, np.ndarray]) -> None:
            qp = arrays["query_positions"]
            j = i % len(qp)
            if mode == "set":
                qp[j] = value
            elif mode == "swap":
                qp[[j, (j + 1) % len(qp)]] = qp[[(j + 1) % len(qp), j]]
            else:
                qp[j] = qp[(j + 1) % len(qp)]

        before = load_file(str(p / "tensors.safetensors"))["query_positions"]
        edit_tensors(p, damage)
        assume(not np.array_equal(before, load_file(str(p / "tensors.safetensors"))["query_positions"]))
        exc = expect_rejected_on_open(p, None, ("query_positions", "query_index"), (cmd,))
        assert exc.file.endswith("tensors.safetensors" if exc.field == "query_positions" else "positions.parquet")
    count("query-positions")


# ----------------------------------------------------------------------------- dtypes and tables
def _model_dtype(value: Any) -> Callable[[Path], None]:
    return lambda p: edit_meta(p, lambda m: m["model"].update(dtype=value))


def _header_dtype(tensor: str, value: str) -> Callable[[Path], None]:
    def damage(p: Path) -> None:
        header, data = read_header(p)
        header[tensor]["dtype"] = value
        write_header(p, header, data)
    return damage


DTYPES: dict[str, tuple[Callable[[Path], Any], str, str]] = {
    **{f"model-{v}": (_model_dtype(v), "meta.json", "model.dtype") for v in ("bfloat16", "int8", "float64", "")},
    "model-number": (_model_dtype(16), "meta.json", "model.dtype"),
    "model-null": (_model_dtype(None), "meta.json", "model.dtype"),
    "model-float32-tensors-f16": (_model_dtype("float32"), "tensors.safetensors", "keys"),
    **{f"keys-{v}": (_header_dtype("keys", v), "tensors.safetensors", "keys.dtype") for v in ("BF16", "F64", "F8_E4M3", "f16")},
    "keys-I64": (_header_dtype("keys", "I64"), "tensors.safetensors", "keys.data_offsets"),
    "query-positions-F16": (_header_dtype("query_positions", "F16"), "tensors.safetensors", "query_positions.data_offsets"),
}


@pytest.mark.parametrize("case", sorted(DTYPES))
def test_dtypes(good: Path, case: str) -> None:
    damage, file, field = DTYPES[case]
    with broken_copy(good) as p:
        damage(p)
        expect_rejected_on_open(p, file, field, (one_command(case),))
    count("dtype")


def _col(expr: pl.Expr) -> Callable[[pl.DataFrame], pl.DataFrame]:
    return lambda df: df.with_columns(expr)


def _at(name: str, kind: str, value: Any) -> pl.Expr:
    """Column ``name`` with ``value`` in the first row of kind ``kind``."""
    first = pl.col("kind") == kind
    first = first & (first.cum_sum() == 1)
    return pl.when(first).then(pl.lit(value)).otherwise(pl.col(name)).alias(name)


POSITION_CASES: dict[str, tuple[Callable[[pl.DataFrame], pl.DataFrame], str]] = {
    "missing-column": (lambda df: df.drop("audio_end_s"), "audio_end_s"),
    "position-float": (_col(pl.col("position").cast(pl.Float64)), "position"),
    "kind-int": (_col(pl.int_range(pl.len()).alias("kind")), "kind"),
    "null-kind": (_col(_at("kind", "text", None)), "kind"),
    "unknown-kind": (_col(_at("kind", "text", "video")), "kind"),
    "no-audio": (_col(pl.col("kind").replace({"audio": "text"})), "kind"),
    "generated-in-prompt": (_col(_at("kind", "text", "generated")), "kind"),
    "rows-missing": (lambda df: df.head(df.height - 1), "position"),
    "positions-shuffled": (_col(pl.col("position").reverse()), "position"),
    "null-token": (_col(_at("token_id", "text", None)), "token_id"),
    "audio-nan-start": (_col(_at("audio_start_s", "audio", float("nan"))), "audio_start_s"),
    "audio-null-end": (_col(_at("audio_end_s", "audio", None)), "audio_end_s"),
    "audio-negative": (_col(_at("audio_start_s", "audio", -1.0)), "audio_start_s"),
    "audio-empty-span": (_col(pl.when(pl.col("kind") == "audio").then(pl.col("audio_start_s"))
                              .otherwise(pl.col("audio_end_s")).alias("audio_end_s")), "audio_end_s"),
    "audio-out-of-order": (_col(pl.col("audio_start_s").reverse()), ("audio_start_s", "audio_end_s")),
    "word-inf": (_col(_at("word_start_s", "generated", float("inf"))), "word_start_s"),
    "word-ends-first": (_col(_at("word_start_s", "generated", 1e3)), "word_end_s"),
    "confidence-2": (_col(pl.lit(2.0).alias("word_confidence")), "word_confidence"),
    "query-index": (_col(_at("query_index", "generated", 0)), "query_index"),
    "garbage": (None, "<parquet>"),
}


@pytest.mark.parametrize("case", sorted(POSITION_CASES))
def test_positions_table(good: Path, case: str) -> None:
    edit, field = POSITION_CASES[case]
    with broken_copy(good) as p:
        if edit is None:
            (p / "positions.parquet").write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")
            refresh(p, "positions.parquet")
        else:
            edit_positions(p, edit)
        expect_rejected_on_open(p, "positions.parquet", field, (one_command(case),))
    count("positions-table")


HEADS_CASES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "not-object": (lambda h: [h], "format"),
    "format": (lambda h: {**h, "format": "other"}, "format"),
    "version": (lambda h: {**h, "version": "1"}, "version"),
    "shape": (lambda h: {**h, "voice_score": h["voice_score"][:1]}, "voice_score"),
    "wrong-model-shape": (lambda h: {**h, "n_layers": 1, "voice_score": h["voice_score"][:1],
                                     "sensitivity": h["sensitivity"][:1]}, "voice_score"),
    "nan": (lambda h: {**h, "sensitivity": [[float("nan")] * len(r) for r in h["sensitivity"]]}, "sensitivity"),
    "negative": (lambda h: {**h, "voice_score": [[-1.0] * len(r) for r in h["voice_score"]]}, "voice_score"),
    "ragged": (lambda h: {**h, "voice_score": [[1.0], [1.0, 2.0]]}, "voice_score"),
    "strings": (lambda h: {**h, "voice_score": [["a", "b"]] * len(h["voice_score"])}, "voice_score"),
    "missing": (lambda h: {k: v for k, v in h.items() if k != "sensitivity"}, "sensitivity"),
}


@pytest.mark.parametrize("case", sorted(HEADS_CASES))
def test_heads_json(good: Path, case: str) -> None:
    edit, field = HEADS_CASES[case]
    with broken_copy(good) as p:
        heads = json.loads((p / "heads.json").read_text())
        (p / "heads.json").write_text(json.dumps(edit(heads)))
        refresh(p, "heads.json")
        expect_rejected_on_open(p, "heads.json", field, (one_command(case),))
    count("heads-json")


# ----------------------------------------------------------------------------- directories and names
@pytest.mark.parametrize("case", ["missing", "file", "fifo", "interrupted", "empty-folder", "no-meta"])
def test_directory(good: Path, tmp_path: Path, case: str) -> None:
    p = tmp_path / ("bad.kvtrace.tmp-1234" if case == "interrupted" else "bad.kvtrace")
    if case == "file":
        p.write_text("x")
    elif case == "fifo":
        os.mkfifo(p)
    elif case == "interrupted":
        shutil.copytree(good, p)
    elif case == "empty-folder":
        p = tmp_path / "folder"
        p.mkdir()
    elif case == "no-meta":
        shutil.copytree(good, p)
        (p / "meta.json").unlink()
    field = "<file>" if case == "no-meta" else "<directory>"
    no_trace = case in ("missing", "empty-folder")  # no work to do: exit 2, as replay's
    for cmd, label in (("validate", "BROKEN"), ("info", "error:"), ("mismatch", "error:"), ("alignment", "error:")):
        res = runner.invoke(app, [cmd, str(p)])
        assert res.exit_code == (2 if no_trace else 1), res.output
        lines = error_lines(res, label)
        assert len(lines) == 1 and f"{p}" in lines[0] and f": {field}: " in lines[0], res.output
    res = runner.invoke(app, ["replay", str(p), "-p", "full", "-o", str(tmp_path / "out")])
    assert res.exit_code == (2 if no_trace else 1), res.output
    count("directory")


MARKUP = "[/x] [bold]b[/bold] :smile: [red]"


def test_bracket_names_round_trip(good: Path, tmp_path: Path) -> None:
    """Names that are globs or rich markup are plain names: written, read back, printed."""
    data_dir = tmp_path / "a[" / "x]"
    for name in ("talk [part 1].kvtrace", "[bold]x[red].kvtrace", "*?.kvtrace"):
        p = data_dir / name
        shutil.copytree(good, p)
        edit_meta(p, lambda m: m.update(generated_text=MARKUP, prompt=MARKUP, reference_text=MARKUP,
                                        provenance={"note": MARKUP}))
        assert validate_trace(p).positions.height > 0
        res = runner.invoke(app, ["info", str(p)])
        assert res.exit_code == 0 and "Traceback" not in res.output, res.output
        assert res.output.count(MARKUP) >= 3, res.output
        res = runner.invoke(app, ["validate", str(p)])
        assert res.exit_code == 0 and f"ok     {p}" in res.output
        count("names")
    res = runner.invoke(app, ["replay", str(data_dir), "-p", "full", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert sorted(pl.read_parquet(tmp_path / "o" / "results.parquet")["trace"]) == ["*?", "[bold]x[red]", "talk [part 1]"]
    count("names")


def test_writer_round_trips_bracket_name(tmp_path: Path) -> None:
    from kvsim.synth import SynthConfig, synthesize

    path = write_trace(tmp_path / "talk [part 1].kvtrace",
                       synthesize(SynthConfig(preset="tiny", audio_seconds=3, decode_steps=3, seed=1)))
    assert validate_trace(path).name == "talk [part 1]"
    count("names")


def test_broken_trace_with_markup_name_is_one_plain_line(good: Path, tmp_path: Path) -> None:
    p = tmp_path / "a[" / "x] [bold].kvtrace"
    shutil.copytree(good, p)
    edit_meta(p, lambda m: m.update(schema="[/x]"))
    expect_rejected_on_open(p, "meta.json", "schema", ("info", "replay", "mismatch", "alignment"))
    count("names")
