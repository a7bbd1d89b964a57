"""Write a trace directory atomically (see :mod:`kvsim.trace.schema` for the layout)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import polars as pl

from kvsim.core.shapes import HeadScores
from kvsim.trace.atomic import atomic_directory
from kvsim.trace.heads import heads_to_json
from kvsim.trace.safetensors_stream import SafetensorsStream
from kvsim.trace.schema import (
    HEADS_FILE,
    META_FILE,
    POSITION_COLUMNS,
    POSITION_KINDS,
    POSITIONS_FILE,
    TENSORS_FILE,
    TRACE_SUFFIX,
    ModelFacts,
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


def trace_path(path: str | Path) -> Path:
    """The ``*.kvtrace`` directory a trace written to ``path`` lands in (the suffix added
    when missing)."""
    path = Path(path)
    return path if path.suffix == TRACE_SUFFIX else path.with_name(path.name + TRACE_SUFFIX)


class TraceWriter:
    """Write a trace layer by layer, atomically, holding no more than the layer handed over.

    The files go into a temporary sibling directory; keys, queries and values are written
    into ``tensors.safetensors`` one layer at a time (:meth:`write_layer`, converted to the
    storage dtype then), then :meth:`finish` writes the tables and ``meta.json`` (sizes and
    SHA-256 of every file, written last); on leaving the ``with`` block without error the
    directory is fsynced and renamed into place. An error or a missing :meth:`finish` leaves
    only a ``*.tmp-*`` directory, which no reader accepts as a trace.

    Parameters
    ----------
    path : str or Path
        The ``*.kvtrace`` directory (the suffix is added when missing).
    model : ModelFacts
        Shape and storage dtype of the tensors.
    n_positions : int
        N, positions of the keys (and values).
    query_positions : (N_q,) int array
        Absolute positions of the stored queries, ascending.
    has_values : bool
        Whether values are written too.
    overwrite : bool
        Replace a directory already at the path (default); when False, raise
        :class:`FileExistsError` if one is there on entry or when the write completes.
    """

    def __init__(self, path: str | Path, model: ModelFacts, n_positions: int,
                 query_positions: np.ndarray, has_values: bool, *, overwrite: bool = True) -> None:
        self.path = trace_path(path)
        self.model, self.has_values, self._overwrite = model, has_values, overwrite
        self._query_positions = np.ascontiguousarray(query_positions, dtype=np.int64)
        self._n_positions = n_positions
        self._stack = contextlib.ExitStack()
        self._finished = False

    def __enter__(self) -> TraceWriter:
        m, dtype = self.model, np.dtype(self.model.dtype)
        kv_shape = (m.n_layers, m.n_kv_heads, self._n_positions, m.head_dim)
        tensors = {"keys": (dtype, kv_shape),
                   "queries": (dtype, (m.n_layers, m.n_q_heads, len(self._query_positions), m.head_dim)),
                   "query_positions": (np.dtype(np.int64), self._query_positions.shape)}
        if self.has_values:
            tensors["values"] = (dtype, kv_shape)
        with contextlib.ExitStack() as stack:
            self._tmp = stack.enter_context(atomic_directory(self.path, self._overwrite))
            self._tensors = stack.enter_context(SafetensorsStream(
                self._tmp / TENSORS_FILE, tensors, metadata={"format": "kvsim.trace"}))
            self._tensors.write("query_positions", self._query_positions)
            self._stack = stack.pop_all()
        return self

    def write_layer(self, layer: int, keys: np.ndarray, queries: np.ndarray,
                    values: np.ndarray | None = None) -> None:
        """Write (H_kv, N, D) keys, (H_q, N_q, D) queries and, when stored, (H_kv, N, D) values
        of ``layer``."""
        if (values is not None) != self.has_values:
            raise ValueError(f"layer {layer}: values {'missing' if self.has_values else 'unexpected'}")
        self._tensors.write("keys", keys, layer)
        self._tensors.write("queries", queries, layer)
        if values is not None:
            self._tensors.write("values", values, layer)

    def finish(self, meta: TraceMeta, positions: pl.DataFrame,
               head_scores: HeadScores | None = None) -> None:
        """Close the tensors (every layer must have been written), write the position table,
        the head scores and, last, ``meta.json`` listing every file with size and SHA-256."""
        tmp = self._tmp
        self._tensors.close()
        positions.write_parquet(tmp / POSITIONS_FILE, statistics=False)
        written = [TENSORS_FILE, POSITIONS_FILE]
        if head_scores is not None:
            (tmp / HEADS_FILE).write_text(json.dumps(heads_to_json(head_scores, meta.model.name), indent=1))
            written.append(HEADS_FILE)
        meta.has_values = self.has_values
        meta.has_head_scores = head_scores is not None
        if not meta.provenance:
            meta.provenance = default_provenance()
        meta.files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
                      for name in written}
        (tmp / META_FILE).write_text(json.dumps(meta.to_json(), indent=1))
        self._finished = True

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None and not self._finished:
            exc = RuntimeError(f"{self.path}: TraceWriter left without finish()")
            self._stack.__exit__(type(exc), exc, None)
            raise exc
        self._stack.__exit__(exc_type, exc, tb)


def write_trace(path: str | Path, data: TraceData, overwrite: bool = True) -> Path:
    """Write ``data`` to ``path`` (a ``*.kvtrace`` directory) atomically and return the path.

    The directory appears complete or not at all (see :class:`TraceWriter`, which writes it a
    layer at a time: memory beyond ``data`` is one layer in the storage dtype). A directory
    already at ``path`` is replaced, unless ``overwrite`` is False: then it is kept and
    :class:`FileExistsError` raised.
    """
    _check(data)
    m = data.meta.model
    with TraceWriter(path, m, data.meta.n_positions, data.query_positions,
                     data.values is not None, overwrite=overwrite) as writer:
        for layer in range(m.n_layers):
            writer.write_layer(layer, data.keys[layer], data.queries[layer],
                               None if data.values is None else data.values[layer])
        writer.finish(data.meta, data.positions, data.head_scores)
    return writer.path
