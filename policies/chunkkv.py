"""ChunkKV (Liu et al., 2025): keep whole semantic chunks of the audio instead of single tokens.

ChunkKV (method section, Algorithm 1) cuts the context into fixed-size chunks of
``chunk_size`` tokens (10 in the paper), scores each chunk by the observation-window attention
summed over the chunk's tokens, and keeps the top ``floor(budget / chunk_size)`` chunks, so
that kept tokens come in contiguous, meaning-preserving groups. The chunk ranking is computed
from the attention summed over the heads of a layer, so every KV-head of a layer keeps the same
chunks (this is what makes ChunkKV's layer-wise index reuse possible). It is prefill-only.

Choices under the audio-only scope (WnW §3.3):

* chunks tile the audio span from its first position; the last chunk may be shorter, and its
  score is scaled to a full chunk (mean token score x ``chunk_size``, as NVIDIA kvpress does);
* to hit the per-head budget ``floor(r * T_a)`` exactly (ChunkKV's whole chunks would leave
  up to ``chunk_size - 1`` tokens unused, i.e. r_GPU off by up to 9/375 = 0.024 at T_a = 375), the
  remainder is filled from the next-best chunk, by token score within that chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._params import require_bool, require_int
from kvsim.policies._scoring import uniform_head_budget, window_scores
from kvsim.policies.base import (
    TIER_GONE,
    TIER_GPU,
    Policy,
    PolicyContext,
    PrefillView,
)
from kvsim.policies.registry import register


@register
@dataclass
class ChunkKV(Policy):
    """Top chunks by summed observation-window attention, shared across a layer's heads.

    Parameters
    ----------
    chunk_size : int
        Tokens per chunk (ChunkKV: chunk size 10, its default).
    window : int
        Observation-window length (last prompt queries; 32 as the SnapKV reference code's
        ``window_size``, which ChunkKV's scoring builds on).
    share_heads : bool
        Rank chunks once per layer from attention summed over heads (ChunkKV); False ranks
        them per KV-head.
    """

    name = "chunkkv"
    paper = (
        "Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient "
        "Long-Context LLM Inference, 2025"
    )

    chunk_size: int = 10
    window: int = 32
    share_heads: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "chunk_size", self.chunk_size, lo=1)
        require_int(n, "window", self.window, lo=1)
        require_bool(n, "share_heads", self.share_heads)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        scores = window_scores(ctx, view, self.window)  # (L, H_kv, T_a)
        if self.share_heads:
            scores = scores.sum(axis=1, keepdims=True)  # (L, 1, T_a)
        budget = uniform_head_budget(ctx, self.budget)
        keep = np.zeros(scores.shape, dtype=bool)
        for idx in np.ndindex(scores.shape[:2]):
            keep[idx] = select_chunks(scores[idx], self.chunk_size, budget)
        keep = np.broadcast_to(keep, (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio))
        self._capacity = budget * ctx.heads.n_heads_total
        return np.where(keep, TIER_GPU, TIER_GONE)

    def gpu_capacity(self) -> int | None:
        return self._capacity


def chunk_scores(token_scores: np.ndarray, chunk_size: int) -> np.ndarray:
    """Score of every chunk: sum of its tokens' scores (a short last chunk is scaled up)."""
    n = token_scores.shape[-1]
    starts = np.arange(0, n, chunk_size)
    sizes = np.minimum(starts + chunk_size, n) - starts
    return np.add.reduceat(token_scores, starts, axis=-1) * (chunk_size / sizes)


def select_chunks(token_scores: np.ndarray, chunk_size: int, budget: int) -> np.ndarray:
    """Boolean keep-mask (T_a,) of exactly ``budget`` tokens: best chunks whole, then the
    best tokens of the next chunk for the remainder (ChunkKV Algorithm 1, top-k chunks)."""
    n = token_scores.shape[-1]
    keep = np.zeros(n, dtype=bool)
    budget = min(max(budget, 0), n)
    order = np.argsort(-chunk_scores(token_scores, chunk_size), kind="stable")
    left = budget
    for c in order:
        if left == 0:
            break
        lo, hi = c * chunk_size, min((c + 1) * chunk_size, n)
        if hi - lo <= left:
            keep[lo:hi] = True
            left -= hi - lo
        else:
            best = np.argsort(-token_scores[lo:hi], kind="stable")[:left]
            keep[lo + best] = True
            left = 0
    return keep
