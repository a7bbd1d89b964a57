"""Ada-KV (Feng et al., 2025) on SnapKV scoring: head-wise adaptive budgets within each layer.

Scoring is SnapKV's (observation-window attention summed over the window and the GQA group,
then pooled; WnW App. F: kernel 7, max pooling). Allocation follows Ada-KV's "Ada-SnapKV"
(paper Alg. 1 and the authors' ``AdaptiveSnapKVCluster``): with the uniform per-head budget
``B = floor(r · T_a)``,

1. take the layer-wide top ``H_kv · B`` over the scores of *all* heads of the layer and count
   how many each head won: ``c_i`` (heads whose attention is spread out win more);
2. the safeguard mixes that with the uniform share:
   ``b_i = (1 - floor_alpha) · c_i + floor_alpha · B`` (WnW App. F: floor_alpha = 0.8, i.e.
   80% of every head's budget is uniform and 20% follows the layer-wide competition);
3. each head keeps its own top ``b_i`` positions.

The reference code floors ``floor_alpha · B`` and rounds ``b_i`` independently, so its total can
drift by a few tokens; we keep ``floor_alpha · B`` unrounded and round the ``b_i`` by largest
remainder so that ``Σ_i b_i = H_kv · B`` exactly (same r_GPU as SnapKV). ``floor_alpha = 1`` is
SnapKV's uniform allocation, ``0`` is Ada-KV without safeguard. Prefill-only (GONE, no recall),
audio span only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._allocation import allocate
from kvsim.policies._params import require_real
from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import (
    PolicyContext,
    PrefillView,
    descending_ranks,
    shared,
    topk_from_ranks,
    topk_mask,
)
from kvsim.policies.registry import register
from kvsim.policies.snapkv import SnapKV


def adaptive_head_budgets(scores: np.ndarray, per_head: int, floor_alpha: float,
                          layer_ranks: np.ndarray | None = None) -> np.ndarray:
    """Ada-KV per-head budgets for one layer's scores (H_kv, T_a); they sum to H_kv·per_head.

    ``c_i`` = entries head ``i`` holds in the layer-wide top ``H_kv · per_head`` (ties: lower
    head, then earlier position); ``b_i ≈ (1 - floor_alpha) · c_i + floor_alpha · per_head``.
    ``layer_ranks``: the :func:`descending_ranks` of the flattened scores, if already known.
    """
    n_heads, n_pos = scores.shape
    per_head = min(per_head, n_pos)
    if layer_ranks is None:
        layer_ranks = descending_ranks(scores.astype(np.float64).ravel())
    won = topk_from_ranks(layer_ranks, n_heads * per_head).reshape(scores.shape)
    counts = won.sum(axis=1)
    shares = (1.0 - floor_alpha) * counts + floor_alpha * per_head
    return allocate(n_heads * per_head, shares, n_pos)


def adaptive_head_allocation(scores: np.ndarray, per_head: int, floor_alpha: float) -> np.ndarray:
    """Ada-KV keep mask (H_kv, T_a) for one layer: each head's top ``b_i`` (see above)."""
    return topk_mask(scores, adaptive_head_budgets(scores, per_head, floor_alpha))


@register
@dataclass
class AdaKV(SnapKV):
    """SnapKV scores with Ada-KV's safeguarded head-wise budget allocation per layer.

    Parameters
    ----------
    window : int
        Observation-window queries (32: the SnapKV reference code's ``window_size``, which
        Ada-KV's SnapKV-based scoring uses).
    kernel : int
        Pooling kernel (WnW App. F: 7).
    pooling : str
        ``"max"`` (WnW App. F) or ``"avg"``.
    floor_alpha : float
        Uniform fraction of every head's budget (WnW App. F: 0.8).
    """

    name = "adakv"
    paper = "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation, NeurIPS 2025; WnW App. F"

    pooling: str = "max"  # SnapKV's window and kernel, WnW App. F's max pooling
    floor_alpha: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()  # SnapKV's checks of window, kernel, pooling
        require_real(self.name, "floor_alpha", self.floor_alpha, lo=0, hi=1)

    def head_budgets(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Ada-KV's safeguarded head-wise budgets (L, H_kv), each layer summing to H_kv * B."""
        scores = self.score(ctx, view)
        # the layer-wide ranks do not depend on the budget either: once for every AdaKV run
        layer_ranks = shared(view, ("adakv-layer-ranks", self.window, self.kernel, self.pooling),
                             lambda: descending_ranks(scores.reshape(len(scores), -1)))
        per_head = uniform_head_budget(ctx, self.budget)
        self.head_budgets_ = np.stack([
            adaptive_head_budgets(s, per_head, self.floor_alpha, r)
            for s, r in zip(scores, layer_ranks, strict=True)])
        return self.head_budgets_
