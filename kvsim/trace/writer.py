"""Write a trace directory atomically (see :mod:`kvsim.trace.schema` for the layout)."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from safetensors.numpy import save_file

from kvsim.core.shapes import HeadScores
from kvsim.trace.atomic import atomic_directory
from kvsim.trace.heads import heads_to_json
from kvsim.trace.schema import (
    HEADS_FILE,
    META_FILE,
    POSITION_COLUMNS,
    POSITION_KINDS,
    POSITIONS_FILE,
    TENSORS_FILE,
    TRACE_SUFFIX,
    TraceMeta,
)


@dataclass
class TraceData:
    """Everything a trace holds, in memory, ready to be written."""

    meta: TraceMeta
    keys: np.ndarray  #: (L, H_kv, N, D)
    queries: np.ndarray  #: (L, H_q, N_q, D)
    query_positions: np.ndarray  #: (N_q,) ascending absolute positions
    positions: pl.DataFrame  #: one row per position, columns of POSITION_COLUMNS
    values: np.ndarray | None = None  #: (L, H_kv, N, D)
    head_scores: HeadScores | None = None


def positions_frame(
    kinds: list[str] | np.ndarray,
    token_ids: np.ndarray,
    query_positions: np.ndarray,
    audio_start_s: np.ndarray | None = None,
    audio_end_s: np.ndarray | None = None,
    words: list[str | None] | None = None,
    word_start_s: np.ndarray | None = None,
    word_end_s: np.ndarray | None = None,
) -> pl.DataFrame:
    """Build the per-position table; NaN times become nulls."""
    n = len(kinds)
    qidx = np.full(n, -1, dtype=np.int64)
    qidx[np.asarray(query_positions, dtype=np.int64)] = np.arange(len(query_positions))

    def col(arr: np.ndarray | None) -> list[float | None]:
        if arr is None:
            return [None] * n
        return [None if not np.isfinite(x) else float(x) for x in np.asarray(arr, dtype=float)]

    return pl.DataFrame(
        {
            "position": np.arange(n, dtype=np.int64),
            "kind": list(kinds),
            "token_id": np.asarray(token_ids, dtype=np.int64),
            "audio_start_s": col(audio_start_s),
            "audio_end_s": col(audio_end_s),
            "word": list(words) if words is not None else [None] * n,
            "word_start_s": col(word_start_s),
            "word_end_s": col(word_end_s),
            "query_index": qidx,
        },
        schema=POSITION_COLUMNS,
    )


def _check(data: TraceData) -> None:
    m = data.meta.model
    n = data.meta.n_positions
    want_k = (m.n_layers, m.n_kv_heads, n, m.head_dim)
    if data.keys.shape != want_k:
        raise ValueError(f"keys shape {data.keys.shape} != {want_k}")
    if data.values is not None and data.values.shape != want_k:
        raise ValueError(f"values shape {data.values.shape} != {want_k}")
    nq = len(data.query_positions)
    want_q = (m.n_layers, m.n_q_heads, nq, m.head_dim)
    if data.queries.shape != want_q:
        raise ValueError(f"queries shape {data.queries.shape} != {want_q}")
    if data.positions.height != n:
        raise ValueError(f"positions table has {data.positions.height} rows, expected {n}")
    bad = set(data.positions["kind"].unique().to_list()) - set(POSITION_KINDS)
    if bad:
        raise ValueError(f"unknown position kinds {bad}")
    decode = np.arange(data.meta.n_prefill, n)
    if not np.isin(decode, data.query_positions).all():
        raise ValueError("every decode position needs a stored query")


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def default_provenance() -> dict[str, Any]:
    import kvsim

    return {
        "kvsim": kvsim.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "host": platform.node(),
        "platform": platform.platform(),
    }


def write_trace(path: str | Path, data: TraceData, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` (a ``*.kvtrace`` directory) atomically and return the path.

    The directory appears complete or not at all: files are written into a temporary sibling,
    fsynced, listed with size and SHA-256 in ``meta.json`` (written last), then renamed.
    """
    path = Path(path)
    if path.suffix != TRACE_SUFFIX:
        path = path.with_name(path.name + TRACE_SUFFIX)
    _check(data)
    dtype = np.dtype(data.meta.model.dtype)
    tensors = {
        "keys": np.ascontiguousarray(data.keys, dtype=dtype),
        "queries": np.ascontiguousarray(data.queries, dtype=dtype),
        "query_positions": np.ascontiguousarray(data.query_positions, dtype=np.int64),
    }
    if data.values is not None:
        tensors["values"] = np.ascontiguousarray(data.values, dtype=dtype)
    meta = data.meta
    meta.has_values = data.values is not None
    meta.has_head_scores = data.head_scores is not None
    if not meta.provenance:
        meta.provenance = default_provenance()

    with atomic_directory(path) as tmp:
        save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "kvsim.trace"})
        data.positions.write_parquet(tmp / POSITIONS_FILE, statistics=False)
        written = [TENSORS_FILE, POSITIONS_FILE]
        if data.head_scores is not None:
            (tmp / HEADS_FILE).write_text(
                json.dumps(heads_to_json(data.head_scores, meta.model.name), indent=1)
            )
            written.append(HEADS_FILE)
        meta.files = {
            name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
            for name in written
        }
        (tmp / META_FILE).write_text(json.dumps(meta.to_json(), indent=1))
    return path
