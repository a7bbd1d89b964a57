"""Ada-KV (Feng et al., 2025) on SnapKV scoring: head-wise adaptive budgets within each layer.

Scoring is SnapKV's (observation-window attention summed over the window and the GQA group,
then pooled; WnW App. F: kernel 7, max pooling). Allocation is Ada-KV's (Feng et al. 2025,
"Ada-SnapKV", Alg. 1 with the safeguard of §4): the layer's total budget
``B_l = H_kv · floor(r · T_a)`` is spent as one top-k over the scores of *all* heads of the
layer, so heads whose attention is spread out get more than heads whose attention is
concentrated. The safeguard keeps every head from collapsing: each head first keeps its own
top ``floor(floor_alpha · floor(r · T_a))`` positions (its guaranteed floor, WnW App. F
floor_alpha = 0.8, i.e. 80% of the layer budget is split uniformly), and only the remaining
``B_l - H_kv · floor`` tokens are chosen by the layer-wide top-k among positions not yet
kept. ``floor_alpha = 1`` is SnapKV's uniform allocation; ``0`` is Ada-KV without safeguard.
Prefill-only: evicted positions are GONE, nothing changes during decoding. Audio span only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies._scoring import pool_scores, uniform_head_budget, window_scores
from policies.base import Policy, PolicyContext, PrefillView, Tier, topk_mask
from policies.registry import register


def adaptive_head_allocation(scores: np.ndarray, per_head: int, floor_alpha: float) -> np.ndarray:
    """Ada-KV keep mask for one layer's scores (H_kv, T_a) at a uniform per-head budget.

    Every head keeps its top ``floor(floor_alpha · per_head)``; the rest of the layer budget
    ``H_kv · per_head`` goes to the largest remaining scores across all heads (ties: lower
    head, then earlier position). Returns a bool (H_kv, T_a) mask with exactly
    ``min(H_kv · per_head, H_kv · T_a)`` entries set.
    """
    n_heads, n_pos = scores.shape
    per_head = min(per_head, n_pos)
    guaranteed = int(np.floor(floor_alpha * per_head + 1e-9))
    keep = topk_mask(scores, guaranteed)
    rest = n_heads * per_head - int(keep.sum())
    if rest > 0:
        flat = np.where(keep, -np.inf, scores.astype(np.float64)).ravel()
        keep |= topk_mask(flat, rest).reshape(keep.shape) & ~keep
    return keep


@register
@dataclass
class AdaKV(Policy):
    """SnapKV scores with Ada-KV's safeguarded head-wise budget allocation per layer.

    Parameters
    ----------
    window : int
        Observation-window queries (SnapKV default 32).
    kernel : int
        Pooling kernel (WnW App. F: 7).
    pooling : str
        ``"max"`` (WnW App. F) or ``"avg"``.
    floor_alpha : float
        Fraction of each head's uniform share it is guaranteed (WnW App. F: 0.8).
    """

    name = "adakv"
    paper = "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation, NeurIPS 2025; WnW App. F"

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    floor_alpha: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0.0 <= self.floor_alpha <= 1.0):
            raise ValueError(f"adakv: floor_alpha must be in [0, 1], got {self.floor_alpha}")

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        scores = pool_scores(window_scores(ctx, view, self.window), self.kernel, self.pooling)
        per_head = uniform_head_budget(ctx, self.budget)
        keep = np.stack(
            [adaptive_head_allocation(s, per_head, self.floor_alpha) for s in scores]
        )
        self._capacity = per_head * ctx.heads.n_heads_total
        return np.where(keep, Tier.GPU, Tier.GONE).astype(np.uint8)

    def gpu_capacity(self) -> int | None:
        return self._capacity
