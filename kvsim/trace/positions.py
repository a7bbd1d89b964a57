"""Read and check ``positions.parquet``: one row per position of the trace (the columns of
:data:`kvsim.trace.schema.POSITION_COLUMNS`).

The table is parsed from bytes already read through :mod:`kvsim.trace.members` (so polars
never opens or globs a path: a trace named ``talk [part 1].kvtrace`` reads back), then every
column is checked for type, nulls and range, and against ``meta.json`` and the stored
``query_positions``: the figures computed from it (audio span, speech onset, which query
belongs to which position) are never taken from an inconsistent table.
"""

from __future__ import annotations

import io

import numpy as np
import polars as pl
from polars.exceptions import PanicException

from kvsim.trace.schema import (
    OPTIONAL_POSITION_COLUMNS,
    POSITION_COLUMNS,
    POSITION_KINDS,
    TraceError,
    TraceMeta,
)

_NOT_NULL = ("position", "kind", "token_id", "query_index")


def parse_positions(data: bytes, file: str, meta: TraceMeta, query_positions: np.ndarray) -> pl.DataFrame:
    """The checked positions table of a trace; :class:`TraceError` names the bad column."""
    try:
        df = pl.read_parquet(io.BytesIO(data))
    except (Exception, PanicException) as exc:  # polars/arrow raise many types for garbage input
        raise TraceError(file, "<parquet>", f"unreadable ({type(exc).__name__})") from None
    df = _typed_columns(df, file)
    if df.height != meta.n_positions:
        raise TraceError(file, "position", f"{df.height} rows, meta.json says {meta.n_positions}")
    if not np.array_equal(df["position"].to_numpy(), np.arange(meta.n_positions)):
        raise TraceError(file, "position", "not 0..n_positions-1 in order")
    _check_kinds(df, file, meta)
    expect = np.full(meta.n_positions, -1, dtype=np.int64)
    expect[query_positions] = np.arange(len(query_positions))
    if not np.array_equal(df["query_index"].to_numpy(), expect):
        raise TraceError(file, "query_index", "disagrees with tensors.safetensors query_positions")
    _check_audio_times(df, file)
    _check_word_times(df, file)
    return df


def _typed_columns(df: pl.DataFrame, file: str) -> pl.DataFrame:
    """Check column presence and dtypes; an all-null column is cast to its declared dtype."""
    for col, dtype in {**POSITION_COLUMNS, **OPTIONAL_POSITION_COLUMNS}.items():
        if col not in df.columns:
            if col in POSITION_COLUMNS:
                raise TraceError(file, col, "column missing")
            continue
        if df.schema[col] != dtype:
            if df[col].null_count() != df.height:
                raise TraceError(file, col, f"dtype {df.schema[col]} != {dtype}")
            df = df.with_columns(pl.col(col).cast(dtype))
    for col in _NOT_NULL:
        if df[col].null_count():
            raise TraceError(file, col, f"{df[col].null_count()} null values")
    return df


def _check_kinds(df: pl.DataFrame, file: str, meta: TraceMeta) -> None:
    bad = set(df["kind"].unique().to_list()) - set(POSITION_KINDS)
    if bad:
        raise TraceError(file, "kind", f"unknown kinds {sorted(map(repr, bad))[:5]}")
    kinds = df["kind"].to_numpy()
    if (kinds[meta.n_prefill:] != "generated").any() or (kinds[: meta.n_prefill] == "generated").any():
        raise TraceError(file, "kind", "'generated' must be exactly the decode positions")
    if not (kinds == "audio").any():
        raise TraceError(file, "kind", "no audio positions (a speech trace needs its audio)")


def _check_audio_times(df: pl.DataFrame, file: str) -> None:
    """Every audio position has a finite, non-empty time span; spans start in order."""
    audio = df.filter(pl.col("kind") == "audio")
    for col in ("audio_start_s", "audio_end_s"):
        values = audio[col].to_numpy()
        if audio[col].null_count() or not np.isfinite(values).all() or (values < 0).any():
            raise TraceError(file, col, "audio positions need finite, non-negative times")
    start, end = audio["audio_start_s"].to_numpy(), audio["audio_end_s"].to_numpy()
    if (end <= start).any():
        raise TraceError(file, "audio_end_s", "an audio position's span is empty (end <= start)")
    if (np.diff(start) < 0).any():
        raise TraceError(file, "audio_start_s", "audio positions are not in time order")


def _check_word_times(df: pl.DataFrame, file: str) -> None:
    """Word times and confidences, where present, are finite and in range."""
    for col in ("word_start_s", "word_end_s"):
        values = df[col].drop_nulls().to_numpy()
        if not np.isfinite(values).all() or (values < 0).any():
            raise TraceError(file, col, "word times must be finite and non-negative")
    both = df.select("word_start_s", "word_end_s").drop_nulls()
    if (both["word_end_s"] < both["word_start_s"]).any():
        raise TraceError(file, "word_end_s", "a word ends before it starts")
    if "word_confidence" in df.columns:
        conf = df["word_confidence"].drop_nulls().to_numpy()
        if not ((conf >= 0) & (conf <= 1)).all():
            raise TraceError(file, "word_confidence", "must be in [0, 1]")
