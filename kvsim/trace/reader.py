"""Open a trace lazily: metadata and the positions table eagerly (small), tensors as
read-only memory maps of the safetensors file (a multi-GB trace is never loaded whole)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from kvsim.trace.atomic import OLD_MARK, TMP_MARK
from kvsim.trace.heads import heads_from_json
from kvsim.trace.schema import (
    HEADS_FILE,
    META_FILE,
    OPTIONAL_POSITION_COLUMNS,
    POSITION_COLUMNS,
    POSITION_KINDS,
    POSITIONS_FILE,
    TENSORS_FILE,
    TRACE_SUFFIX,
    TraceError,
    TraceMeta,
)
from policies.base import HeadLayout, HeadScores

_ST_DTYPES = {"F16": np.float16, "BF16": None, "F32": np.float32, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "U8": np.uint8}


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Return (tensor table, byte offset of the data section) of a safetensors file."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise TraceError(name, "<header>", "file too short to be safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                raise TraceError(name, "<header>", f"implausible header size {n}")
            raw = fh.read(n)
    except FileNotFoundError:
        raise TraceError(name, "<file>", "missing") from None
    if len(raw) < n:
        raise TraceError(name, "<header>", "truncated header")
    try:
        table = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TraceError(name, "<header>", "header is not valid JSON") from None
    table.pop("__metadata__", None)
    return table, 8 + n


class Trace:
    """A trace opened for reading.

    Opening checks the structure (schema version, files present with their recorded sizes,
    tensor shapes against the metadata, positions table columns). Use
    :func:`kvsim.trace.validate.validate_trace` for the deep checks (checksums, NaN scan).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        p = self.path
        if TMP_MARK in p.name or OLD_MARK in p.name:
            raise TraceError(str(p), "<directory>", "incomplete trace left by an interrupted write")
        if not p.is_dir():
            raise TraceError(str(p), "<directory>", "not a trace directory" if p.exists() else "missing")
        meta_path = p / META_FILE
        try:
            raw = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise TraceError(str(meta_path), "<file>", "missing (incomplete or not a trace)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(str(meta_path), "<json>", f"invalid JSON ({exc})") from None
        self.meta = TraceMeta.from_json(raw, str(meta_path))
        self._check_files()
        self._tensors, self._data_offset = _read_safetensors_header(p / TENSORS_FILE)
        self._check_tensors()
        self._maps: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ structural checks
    def _check_files(self) -> None:
        required = [TENSORS_FILE, POSITIONS_FILE] + ([HEADS_FILE] if self.meta.has_head_scores else [])
        for name in required:
            f = self.path / name
            if name not in self.meta.files:
                raise TraceError(str(self.path / META_FILE), f"files.{name}", "missing from manifest")
            if not f.exists():
                raise TraceError(str(f), "<file>", "missing")
            want = self.meta.files[name].get("bytes")
            got = f.stat().st_size
            if want != got:
                raise TraceError(str(f), "<file>", f"size {got} bytes, manifest says {want} (truncated or replaced)")

    def _tensor_spec(self, name: str, shape: tuple[int, ...], dtypes: Iterable[str]) -> None:
        f = str(self.path / TENSORS_FILE)
        spec = self._tensors.get(name)
        if spec is None:
            raise TraceError(f, name, "tensor missing")
        if spec.get("dtype") not in dtypes:
            raise TraceError(f, name, f"dtype {spec.get('dtype')} not in {sorted(dtypes)}")
        if tuple(spec.get("shape", ())) != shape:
            raise TraceError(f, name, f"shape {tuple(spec.get('shape', ()))} != {shape} implied by meta.json")
        begin, end = spec["data_offsets"]
        size = (self.path / TENSORS_FILE).stat().st_size
        if self._data_offset + end > size:
            raise TraceError(f, name, "data runs past the end of the file (truncated)")
        itemsize = np.dtype(_ST_DTYPES[spec["dtype"]]).itemsize
        if end - begin != int(np.prod(shape)) * itemsize:
            raise TraceError(f, name, "byte range does not match shape and dtype")

    def _check_tensors(self) -> None:
        m = self.meta.model
        f = str(self.path / TENSORS_FILE)
        qp = self._tensors.get("query_positions")
        if qp is None:
            raise TraceError(f, "query_positions", "tensor missing")
        nq = (qp.get("shape") or [0])[0]
        float_dtypes = {"F16", "F32"}
        kv_shape = (m.n_layers, m.n_kv_heads, self.meta.n_positions, m.head_dim)
        self._tensor_spec("keys", kv_shape, float_dtypes)
        self._tensor_spec("queries", (m.n_layers, m.n_q_heads, nq, m.head_dim), float_dtypes)
        self._tensor_spec("query_positions", (nq,), {"I64"})
        if self.meta.has_values:
            self._tensor_spec("values", kv_shape, float_dtypes)

    # ------------------------------------------------------------------ tensors
    def _map(self, name: str) -> np.ndarray:
        if name not in self._maps:
            spec = self._tensors[name]
            self._maps[name] = np.memmap(
                self.path / TENSORS_FILE,
                dtype=_ST_DTYPES[spec["dtype"]],
                mode="r",
                offset=self._data_offset + spec["data_offsets"][0],
                shape=tuple(spec["shape"]),
            )
        return self._maps[name]

    def keys(self, layer: int) -> np.ndarray:
        """Post-RoPE keys of ``layer``: (H_kv, N, D), memory-mapped, storage dtype."""
        return self._map("keys")[layer]

    def values(self, layer: int) -> np.ndarray | None:
        """Values of ``layer`` (H_kv, N, D) or None if the trace stores none."""
        return self._map("values")[layer] if self.meta.has_values else None

    def queries(self, layer: int) -> np.ndarray:
        """Stored post-RoPE queries of ``layer``: (H_q, N_q, D)."""
        return self._map("queries")[layer]

    @cached_property
    def query_positions(self) -> np.ndarray:
        return np.asarray(self._map("query_positions"), dtype=np.int64)

    def query_index(self, position: int) -> int:
        """Row in :meth:`queries` of the query at absolute ``position``."""
        i = int(np.searchsorted(self.query_positions, position))
        if i >= len(self.query_positions) or self.query_positions[i] != position:
            raise KeyError(f"no query stored for position {position}")
        return i

    # ------------------------------------------------------------------ tables and facts
    @cached_property
    def positions(self) -> pl.DataFrame:
        f = self.path / POSITIONS_FILE
        try:
            df = pl.read_parquet(f)
        except Exception as exc:  # polars/arrow raise many types for garbage input
            raise TraceError(str(f), "<parquet>", f"unreadable ({type(exc).__name__})") from None
        for col, dtype in POSITION_COLUMNS.items():
            if col not in df.columns:
                raise TraceError(str(f), col, "column missing")
            if df.schema[col] != dtype and not (df[col].null_count() == df.height):
                raise TraceError(str(f), col, f"dtype {df.schema[col]} != {dtype}")
        for col, dtype in OPTIONAL_POSITION_COLUMNS.items():
            if col in df.columns and df.schema[col] != dtype and df[col].null_count() != df.height:
                raise TraceError(str(f), col, f"dtype {df.schema[col]} != {dtype}")
        if df.height != self.meta.n_positions:
            raise TraceError(str(f), "position", f"{df.height} rows, meta.json says {self.meta.n_positions}")
        bad = set(df["kind"].unique().to_list()) - set(POSITION_KINDS)
        if bad:
            raise TraceError(str(f), "kind", f"unknown kinds {sorted(map(str, bad))}")
        return df

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

    @cached_property
    def head_scores(self) -> HeadScores | None:
        if not self.meta.has_head_scores:
            return None
        f = self.path / HEADS_FILE
        try:
            raw = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise TraceError(str(f), "<json>", "invalid JSON") from None
        return heads_from_json(raw, str(f))

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(TRACE_SUFFIX)

    @property
    def audio_seconds(self) -> float:
        return self.n_audio / self.meta.model.audio_tokens_per_s

    def tensor_bytes(self) -> int:
        """Raw bytes of the stored tensors (the denominator of the size-overhead figure)."""
        return sum(s["data_offsets"][1] - s["data_offsets"][0] for s in self._tensors.values())

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def __repr__(self) -> str:
        m = self.meta.model
        return (f"Trace({self.name!r}, {m.name}, L={m.n_layers} Hq={m.n_q_heads} "
                f"Hkv={m.n_kv_heads} D={m.head_dim}, audio={self.n_audio}, decode={self.meta.n_decode})")


def find_traces(paths: Iterable[str | Path]) -> list[Path]:
    """Expand arguments into trace directories: a ``*.kvtrace`` directory is itself; any other
    directory is searched recursively for ``*.kvtrace`` directories (interrupted writes
    skipped). Raises FileNotFoundError for a path that does not exist."""
    out: list[Path] = []
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such file or directory")
        if p.suffix == TRACE_SUFFIX or (p / META_FILE).exists():
            out.append(p)
            continue
        found = sorted(
            d for d in p.rglob(f"*{TRACE_SUFFIX}")
            if d.is_dir() and TMP_MARK not in d.name and OLD_MARK not in d.name
        )
        out.extend(found)
    return out
