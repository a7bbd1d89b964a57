"""What one decode step asks of the hardware: resident KV, KV read, and CPU->GPU recalls.

A :class:`StepWorkload` holds per-step (and per-layer for recalls) counts for ONE sequence.
It is built from a replay step log (:func:`from_step_log`, columns of
:mod:`kvsim.core.steplog`) or from an analytic description of a policy
(:mod:`kvsim.sim.analytic`). Token counts are (layer, KV-head) positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import get_type_hints

import numpy as np
import polars as pl

from kvsim.core.steplog import STEP_LOG_COLUMNS, RunFacts


class WorkloadError(ValueError):
    """A step log or analytic description is inconsistent (one-line message)."""


@dataclass
class StepWorkload:
    """Per-step demand of one sequence on the hardware.

    Arrays have one row per decode step; ``*_by_layer`` arrays are (steps, layers).
    """

    facts: RunFacts
    non_audio_tokens: np.ndarray  # per (layer, kv-head): always-resident positions
    gpu_audio_tokens: np.ndarray  # summed over (layer, kv-head)
    read_audio_tokens: np.ndarray  # summed over (layer, kv-head)
    h2d_tokens_by_layer: np.ndarray  # (S, L)
    h2d_runs_by_layer: np.ndarray  # (S, L): contiguous runs recalled
    h2d_segments_by_layer: np.ndarray  # (S, L): (head, segment) pieces recalled
    cpu_audio_tokens: np.ndarray | None = None  # summed over (layer, kv-head): only on CPU
    segments_exact: bool = False  # False: segment counts estimated from a step log

    @property
    def n_steps(self) -> int:
        return int(self.non_audio_tokens.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.h2d_tokens_by_layer.shape[1])

    @property
    def h2d_bytes(self) -> np.ndarray:
        return self.h2d_tokens_by_layer.sum(axis=1) * self.facts.kv_bytes_per_head_token


def facts_from_json(data: object) -> RunFacts:
    """RunFacts from a parsed JSON object (the ``.json`` beside a step log), every field
    checked: present, of its JSON type (``bool`` is no number), finite and in range.
    Raises :class:`WorkloadError` ``field 'x': ...`` (the caller adds the file)."""
    if not isinstance(data, dict):
        raise WorkloadError(f"not a JSON object of RunFacts fields (got {type(data).__name__})")
    types = get_type_hints(RunFacts)
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise WorkloadError(f"field {unknown[0]!r}: not a RunFacts field")
    for f in fields(RunFacts):
        name, kind, low = f.name, types[f.name], f.metadata.get("min")
        if name not in data:
            raise WorkloadError(f"field {name!r}: missing")
        value = data[name]
        if not _of_type(value, kind):
            raise WorkloadError(f"field {name!r}: expected {kind.__name__}, got {value!r}")
        if low is not None and not (math.isfinite(value) and value >= low):
            raise WorkloadError(f"field {name!r}: must be finite and >= {low:g}, got {value!r}")
    return RunFacts(**data)


def _of_type(value: object, kind: type) -> bool:
    """Whether a JSON ``value`` is a ``kind`` (str, int, or float, which takes integers too)."""
    if isinstance(value, bool) or kind is str:
        return kind is str and isinstance(value, str)
    return isinstance(value, int) if kind is int else isinstance(value, int | float)


def _check_columns(step_log: pl.DataFrame) -> None:
    """Every step-log column present, of integers (lists of integers), without nulls."""
    for col, want in STEP_LOG_COLUMNS.items():
        if col not in step_log.columns:
            raise WorkloadError(f"step log: missing column {col!r}")
        dtype = step_log.schema[col]
        listed = isinstance(want, pl.List)
        inner = dtype.inner if listed and isinstance(dtype, pl.List) else None if listed else dtype
        if inner is None or not inner.is_integer():
            raise WorkloadError(f"step log: column {col!r} is {dtype}, expected {want}")
        if not listed and step_log[col].null_count():
            raise WorkloadError(f"step log: column {col!r} has {step_log[col].null_count()} nulls")


def segment_tokens(facts: RunFacts, seconds: float = 2.0) -> int:
    """WnW §2.3 segment size n_s = ceil(W_s * r_tok) (2-s stride: Voxtral 25, Qwen 50)."""
    return max(1, math.ceil(seconds * facts.audio_tokens_per_s))


def _per_layer(df: pl.DataFrame, col: str, total_col: str, n_layers: int) -> np.ndarray:
    """(S, L) array from a list column; spreads the total evenly if the list is empty."""
    s = df.height
    lists = df[col].to_list()
    out = np.zeros((s, n_layers), dtype=np.int64)
    totals = df[total_col].to_numpy()
    for i, row in enumerate(lists):
        if row is not None and len(row) == n_layers:
            out[i] = row
        elif row:
            raise WorkloadError(
                f"step log column {col!r}, step {i}: {len(row)} entries, expected {n_layers} layers"
            )
        elif totals[i]:
            base, rem = divmod(int(totals[i]), n_layers)
            out[i] = base
            out[i, :rem] += 1
    return out


def from_step_log(step_log: pl.DataFrame, facts: RunFacts, n_s: int | None = None) -> StepWorkload:
    """Build a workload from a replay step log (columns of :data:`STEP_LOG_COLUMNS`).

    The number of (head, segment) pieces per layer is not in the log; it is estimated as
    ``min(runs, ceil(tokens / n_s))`` (a recalled piece never spans more than one segment of
    ``n_s`` positions), i.e. a lower bound on per-segment copies.
    """
    _check_columns(step_log)
    if step_log.height == 0:
        raise WorkloadError("step log: no decode steps")
    df = step_log.sort("step")
    L = facts.n_layers
    tok = _per_layer(df, "h2d_tokens_by_layer", "h2d_tokens", L)
    runs = _per_layer(df, "h2d_transfers_by_layer", "h2d_transfers", L)
    if (tok < 0).any() or (runs < 0).any():
        raise WorkloadError("step log: negative h2d counts")
    n_s = n_s or segment_tokens(facts)
    segs = np.minimum(runs, -(-tok // n_s))
    return StepWorkload(
        facts=facts,
        non_audio_tokens=df["non_audio_tokens"].to_numpy().astype(np.int64),
        gpu_audio_tokens=df["gpu_audio_tokens"].to_numpy().astype(np.int64),
        read_audio_tokens=df["read_audio_tokens"].to_numpy().astype(np.int64),
        h2d_tokens_by_layer=tok,
        h2d_runs_by_layer=runs,
        h2d_segments_by_layer=segs,
        cpu_audio_tokens=df["cpu_audio_tokens"].to_numpy().astype(np.int64),
        segments_exact=False,
    )
