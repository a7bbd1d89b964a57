"""Open a trace: every cheap structural check on open, tensors memory-mapped.

Opening reads and checks ``meta.json`` (schema, types, ranges, the manifest of plain file
names), the member files (regular files inside the directory, of the recorded sizes), the
safetensors header (entries typed, offsets inside the file, shapes and dtypes against
``meta.json``), the stored ``query_positions`` (integers, strictly increasing, in
``[0, n_positions)``, every answer query present), ``positions.parquet`` and ``heads.json``.
Keys, queries and values stay read-only memory maps (a multi-GB trace is never loaded whole);
each layer of them is checked for NaN/inf the first time it is read, so no figure is ever
computed from a non-finite value. The expensive checks of the whole trace (SHA-256 of every
file, NaN/inf scan of every layer) run in :meth:`Trace.verify`, on ``Trace(path,
verify=True)`` and in :func:`kvsim.trace.validate.validate_trace`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from kvsim.core.shapes import HeadLayout, HeadScores
from kvsim.trace.atomic import OLD_MARK, TMP_MARK
from kvsim.trace.heads import heads_from_json
from kvsim.trace.members import MAX_JSON_BYTES, member_sha256, member_size, read_member
from kvsim.trace.positions import parse_positions
from kvsim.trace.safetensors_header import TensorSpec, read_header
from kvsim.trace.schema import (
    HEADS_FILE,
    META_FILE,
    POSITIONS_FILE,
    TENSORS_FILE,
    TRACE_SUFFIX,
    TraceError,
    TraceMeta,
)
from kvsim.trace.tensors import check_query_positions, check_tensor_table, first_nonfinite


def read_json_member(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON member file; :class:`TraceError` on unreadable or invalid JSON."""
    try:
        return json.loads(read_member(path, limit))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        detail = f": {exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise TraceError(str(path), "<json>", f"invalid JSON{detail}") from None


class Trace:
    """A trace opened for reading (see the module docstring for what opening checks).

    Parameters
    ----------
    path
        The ``*.kvtrace`` directory.
    verify
        Also run :meth:`verify` (checksums and the NaN/inf scan of every tensor).
    """

    def __init__(self, path: str | Path, verify: bool = False) -> None:
        self.path = Path(path)
        p = self.path
        if TMP_MARK in p.name or OLD_MARK in p.name:
            raise TraceError(str(p), "<directory>", "incomplete trace left by an interrupted write")
        if not p.is_dir():
            raise TraceError(str(p), "<directory>", "not a trace directory" if p.exists() else "missing")
        meta_path = p / META_FILE
        member_size(p, META_FILE)
        self.meta = TraceMeta.from_json(read_json_member(meta_path), str(meta_path))
        self._sizes = self._check_members()
        self._tensors: dict[str, TensorSpec] = read_header(p / TENSORS_FILE, self._sizes[TENSORS_FILE])
        check_tensor_table(self._tensors, self.meta, str(p / TENSORS_FILE))
        self._maps: dict[str, np.ndarray] = {}
        self._finite: set[tuple[str, int]] = set()
        self.query_positions = np.array(self._map("query_positions"), dtype=np.int64)
        check_query_positions(self.query_positions, self.meta, str(p / TENSORS_FILE))
        self.positions: pl.DataFrame = parse_positions(
            read_member(p / POSITIONS_FILE, self._sizes[POSITIONS_FILE]), str(p / POSITIONS_FILE),
            self.meta, self.query_positions)
        self.head_scores = self._read_head_scores()
        if verify:
            self.verify()

    # ------------------------------------------------------------------ structural checks
    def _check_members(self) -> dict[str, int]:
        """Every manifest file is a regular file inside the trace of its recorded size."""
        meta_file = str(self.path / META_FILE)
        required = [TENSORS_FILE, POSITIONS_FILE] + ([HEADS_FILE] if self.meta.has_head_scores else [])
        for name in required:
            if name not in self.meta.files:
                raise TraceError(meta_file, f"files.{name}", "missing from manifest")
        sizes = {}
        for name, entry in self.meta.files.items():
            got = member_size(self.path, name)
            if got != entry["bytes"]:
                raise TraceError(str(self.path / name), "<file>",
                                 f"size {got} bytes, manifest says {entry['bytes']} (truncated or replaced)")
            sizes[name] = got
        return sizes

    def _read_head_scores(self) -> HeadScores | None:
        if not self.meta.has_head_scores:
            return None
        f = self.path / HEADS_FILE
        scores = heads_from_json(read_json_member(f, self._sizes[HEADS_FILE]), str(f))
        want = (self.meta.model.n_layers, self.meta.model.n_kv_heads)
        if scores.voice_score.shape != want:
            raise TraceError(str(f), "voice_score", f"shape {scores.voice_score.shape} != (n_layers, n_kv_heads) {want}")
        return scores

    # ------------------------------------------------------------------ deep checks
    def verify(self) -> None:
        """The expensive checks: the SHA-256 of every manifest file and a NaN/inf scan of
        every layer of keys, queries and values."""
        self.verify_checksums()
        self.check_finite()

    def verify_checksums(self) -> None:
        """Compare every manifest file with its recorded SHA-256 (when one is recorded)."""
        for name, entry in self.meta.files.items():
            f = self.path / name
            if entry.get("sha256") and member_sha256(f, self._sizes[name]) != entry["sha256"]:
                raise TraceError(str(f), "<file>", "SHA-256 does not match meta.json (corrupted)")

    def check_finite(self, names: Iterable[str] = ("keys", "queries", "values")) -> None:
        """Scan every layer of the tensors ``names`` (values only when stored) for NaN/inf."""
        for name in names:
            if name == "values" and not self.meta.has_values:
                continue
            for layer in range(self.meta.model.n_layers):
                self._layer(name, layer)

    # ------------------------------------------------------------------ tensors
    def _map(self, name: str) -> np.ndarray:
        if name not in self._maps:
            spec = self._tensors[name]
            self._maps[name] = np.memmap(self.path / TENSORS_FILE, dtype=spec.numpy_dtype, mode="r",
                                         offset=spec.begin, shape=spec.shape)
        return self._maps[name]

    def _layer(self, name: str, layer: int) -> np.ndarray:
        """One layer of a float tensor, checked for NaN/inf on its first read."""
        arr = self._map(name)[layer]
        if (name, layer) not in self._finite:
            self._check_finite(name, layer, arr)
        return arr

    def _check_finite(self, name: str, layer: int, arr: np.ndarray) -> None:
        bad = first_nonfinite(arr)
        if bad is not None:
            raise TraceError(str(self.path / TENSORS_FILE), name,
                             f"non-finite value {arr[bad]} at layer {layer}, index {list(bad)}")
        self._finite.add((name, layer))

    def read_layer(self, name: str, layer: int) -> np.ndarray:
        """One layer of ``keys``, ``queries`` or ``values`` (storage dtype), read into a fresh
        array with plain file reads, checked for NaN/inf.

        Unlike :meth:`keys` (a view of the memory map), the pages read stay in the kernel's
        page cache, not in this process's resident set: a caller that converts every layer
        once (the replay) holds only its own copy.
        """
        if name == "values" and not self.meta.has_values:
            raise TraceError(str(self.path / META_FILE), "has_values", "the trace stores no values")
        spec = self._tensors[name]
        shape = tuple(spec.shape[1:])
        dtype = np.dtype(spec.numpy_dtype)
        count = int(np.prod(shape))
        with open(self.path / TENSORS_FILE, "rb") as fh:
            fh.seek(spec.begin + layer * count * dtype.itemsize)
            arr = np.fromfile(fh, dtype=dtype, count=count)
        if arr.size != count:
            raise TraceError(str(self.path / TENSORS_FILE), name, f"layer {layer} is truncated")
        arr = arr.reshape(shape)
        self._check_finite(name, layer, arr)
        return arr

    def keys(self, layer: int) -> np.ndarray:
        """Post-RoPE keys of ``layer``: (H_kv, N, D), memory-mapped, storage dtype."""
        return self._layer("keys", layer)

    def values(self, layer: int) -> np.ndarray | None:
        """Values of ``layer`` (H_kv, N, D) or None if the trace stores none."""
        return self._layer("values", layer) if self.meta.has_values else None

    def queries(self, layer: int) -> np.ndarray:
        """Stored post-RoPE queries of ``layer``: (H_q, N_q, D)."""
        return self._layer("queries", layer)

    def query_index(self, position: int) -> int:
        """Row in :meth:`queries` of the query at absolute ``position``."""
        i = int(np.searchsorted(self.query_positions, position))
        if i >= len(self.query_positions) or self.query_positions[i] != position:
            raise TraceError(str(self.path / TENSORS_FILE), "query_positions",
                             f"no query stored for position {position}")
        return i

    # ------------------------------------------------------------------ tables and facts
    @cached_property
    def audio_positions(self) -> np.ndarray:
        """Absolute positions of the audio KV, ascending (T_a,)."""
        kinds = self.positions["kind"].to_numpy()
        return np.flatnonzero(kinds == "audio").astype(np.int64)

    @property
    def n_audio(self) -> int:
        return len(self.audio_positions)

    @property
    def padding_recorded(self) -> bool:
        """Whether the trace says which audio positions are padding (optional column)."""
        return "padding" in self.positions.columns

    @cached_property
    def padding_positions(self) -> np.ndarray:
        """Absolute positions of audio tokens encoded from padding past the end of the input
        (ascending); empty when none, or when the trace does not record it (see
        :attr:`padding_recorded`)."""
        if not self.padding_recorded:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.positions["padding"].fill_null(False).to_numpy()).astype(np.int64)

    @cached_property
    def window_positions(self) -> np.ndarray:
        """Prompt positions that have a stored query: the observation window of SnapKV-like
        scoring, ending at the prompt's last position. The tracer stores the last
        :data:`~kvsim.trace.schema.OBSERVATION_WINDOW` (32) prompt positions, audio included
        when fewer text positions follow the audio; older traces stored the prompt positions
        after the audio only, and their window is what they stored."""
        qp = self.query_positions
        return qp[qp < self.meta.n_prefill]

    @property
    def head_layout(self) -> HeadLayout:
        m = self.meta.model
        return HeadLayout(m.n_layers, m.n_q_heads, m.n_kv_heads, m.head_dim)

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(TRACE_SUFFIX)

    @property
    def audio_seconds(self) -> float:
        return self.n_audio / self.meta.model.audio_tokens_per_s

    def tensor_bytes(self) -> int:
        """Raw bytes of the stored tensors (the denominator of the size-overhead figure)."""
        return sum(s.nbytes for s in self._tensors.values())

    def disk_bytes(self) -> int:
        """Bytes of ``meta.json`` and the files of its manifest."""
        return member_size(self.path, META_FILE) + sum(self._sizes.values())

    def __repr__(self) -> str:
        m = self.meta.model
        return (f"Trace({self.name!r}, {m.name}, L={m.n_layers} Hq={m.n_q_heads} "
                f"Hkv={m.n_kv_heads} D={m.head_dim}, audio={self.n_audio}, decode={self.meta.n_decode})")


class DuplicateTraceError(ValueError):
    """One trace named twice among the arguments; ``str()`` is the one-line message."""


def find_traces(paths: Iterable[str | Path]) -> list[Path]:
    """Expand arguments into trace directories: a ``*.kvtrace`` directory is itself; any other
    directory is searched recursively for ``*.kvtrace`` directories (interrupted writes
    skipped). Raises FileNotFoundError for a path that does not exist and
    :class:`DuplicateTraceError` for a trace named twice (see :func:`unique_traces`)."""
    found: list[tuple[Path, Path]] = []
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        found.extend((t, p) for t in _expand(p))
    return unique_traces(found)


def collect_traces(paths: Iterable[str | Path]) -> tuple[list[Path], list[TraceError]]:
    """:func:`find_traces` that goes on past a bad argument: the traces found, and one error
    per argument that is missing or is a folder holding no trace. A trace named twice is not
    a bad argument but a wrong call: :class:`DuplicateTraceError`, as in :func:`find_traces`."""
    found: list[tuple[Path, Path]] = []
    errors: list[TraceError] = []
    for arg in paths:
        p = Path(arg)
        if not p.exists() and not p.is_symlink():
            errors.append(TraceError(str(p), "<directory>", "no such file or directory"))
            continue
        traces = _expand(p)
        if not traces:
            errors.append(TraceError(str(p), "<directory>", f"contains no *{TRACE_SUFFIX}"))
        found.extend((t, p) for t in traces)
    return unique_traces(found), errors


def unique_traces(found: Iterable[tuple[Path, Path]]) -> list[Path]:
    """The traces of ``found`` ((trace, the argument that named it) pairs), in order.

    Raises :class:`DuplicateTraceError` naming both when two are the same directory once
    resolved (the same path twice, ``./t`` and ``t``, a link to it, or a folder holding it
    beside ``t`` itself): every figure is a mean over traces, and one counted twice skews it.
    """
    seen: dict[Path, tuple[Path, Path]] = {}
    out: list[Path] = []
    for trace, arg in found:
        key = trace.resolve()
        if key in seen:
            raise DuplicateTraceError(f"{_named(trace, arg)}: given twice (also as "
                                      f"{_named(*seen[key])}); give each trace once")
        seen[key] = (trace, arg)
        out.append(trace)
    return out


def _named(trace: Path, arg: Path) -> str:
    """``trace``, with the folder argument it was found in when it was not named itself."""
    return str(trace) if trace == arg else f"{trace} (in {arg})"


def _expand(p: Path) -> list[Path]:
    if p.suffix == TRACE_SUFFIX or not p.is_dir() or (p / META_FILE).exists():
        return [p]
    return sorted(d for d in p.rglob(f"*{TRACE_SUFFIX}")
                  if d.is_dir() and TMP_MARK not in d.name and OLD_MARK not in d.name)
