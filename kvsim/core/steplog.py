"""The per-step log of one replay: the contract between the replay engine (or live mode) and
the hardware simulator (:mod:`kvsim.sim`).

One row per decode step. Token counts are summed over all (layer, KV-head) pairs: one "token"
is one position of one KV-head of one layer, i.e. ``2 * head_dim * dtype_bytes`` bytes of K+V.

Timing within a row: ``read_audio_tokens`` is what attention read *during* step ``s``; the
tier counts (``gpu_audio_tokens``, ``cpu_audio_tokens``) and the transfers (``h2d_*``,
``released_tokens``) are those of the tier update made at step ``s`` — inside the step for
query-aware policies (``select``), after it for the others (``decode_step``) — i.e. the state
that step ``s + 1`` starts from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import polars as pl

#: Column -> dtype of a step log.
STEP_LOG_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64(),
    "context_tokens": pl.Int64(),  # positions in the full context at this step (per head)
    "non_audio_tokens": pl.Int64(),  # non-audio positions (always on GPU), per head
    "gpu_audio_tokens": pl.Int64(),  # sum over (layer, kv-head) of GPU-resident audio positions
    "cpu_audio_tokens": pl.Int64(),  # ... of positions held only on CPU (recallable)
    "read_audio_tokens": pl.Int64(),  # ... of audio positions attention read (Quest: < GPU)
    "h2d_tokens": pl.Int64(),  # (layer, kv-head) positions recalled CPU->GPU at this step
    "h2d_bytes": pl.Int64(),  # h2d_tokens * 2 * head_dim * dtype_bytes (K and V)
    "h2d_transfers": pl.Int64(),  # contiguous runs recalled = copies if coalesced per run
    "h2d_tokens_by_layer": pl.List(pl.Int64()),  # per-layer breakdown of h2d_tokens
    "h2d_transfers_by_layer": pl.List(pl.Int64()),  # per-layer breakdown of h2d_transfers
    "released_tokens": pl.Int64(),  # positions leaving GPU at this step (to CPU or GONE)
}


def _at_least(low: float):
    """A required dataclass field whose value must be finite and at least ``low``."""
    return field(metadata={"min": low})


@dataclass(frozen=True)
class RunFacts:
    """What the simulator needs to know about the run that produced a step log. A number's
    lowest valid value is its field's ``metadata["min"]`` (checked when read from JSON,
    :func:`kvsim.sim.workload.facts_from_json`)."""

    model: str
    n_layers: int = _at_least(1)
    n_q_heads: int = _at_least(1)
    n_kv_heads: int = _at_least(1)
    head_dim: int = _at_least(1)
    dtype_bytes: int = _at_least(1)
    n_audio: int = _at_least(0)
    n_prefill: int = _at_least(0)
    n_decode: int = _at_least(0)
    policy: str
    budget: float = _at_least(0)
    audio_tokens_per_s: float = _at_least(0)

    @property
    def kv_bytes_per_head_token(self) -> int:
        """Bytes of K+V for one position of one KV-head of one layer."""
        return 2 * self.head_dim * self.dtype_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def retention_per_step(log: pl.DataFrame, audio_kv_total: int,
                       prefill_r_gpu: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """r_GPU, r_CPU-only and read fraction of every step of a log (WnW §3.4 denominators:
    L * H_kv * T_a); a log without steps gives the prefill state."""
    if not log.height:
        return np.array([prefill_r_gpu]), np.array([0.0]), np.array([prefill_r_gpu])
    return tuple(log[c].to_numpy() / audio_kv_total
                 for c in ("gpu_audio_tokens", "cpu_audio_tokens", "read_audio_tokens"))
