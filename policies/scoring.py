"""The scoring contract: a prefill-only policy written as one ``score`` method.

Most prefill-only compressors (SnapKV, PyramidKV, Ada-KV, AudioKV, StreamingLLM, the random
control) differ only in *what* they score and *how many* positions each (layer, KV-head)
keeps; the rest (top-k under the budget, GONE for the others, a declared GPU capacity, the
tier dtype) is the same. :class:`ScoringPolicy` does that rest once, so that a new scorer is a
dataclass with one method (the split NVIDIA kvpress makes between its ``ScorerPress.score``
and the presses that wrap a scorer).

Level 1 (this module): prefill-only, no recall, tiers fixed for the whole decode. Subclasses
implement :meth:`ScoringPolicy.score` and optionally override

* :meth:`ScoringPolicy.head_budgets`: how many positions each (layer, KV-head) keeps
  (default: the uniform ``floor(r * T_a)`` of the audio-only scope, WnW §3.3; PyramidKV
  overrides it per layer, Ada-KV per head, AudioKV from calibration scores);
* :meth:`ScoringPolicy.ranks`: the descending ranks of the scores, to share them between the
  budgets of one run (they do not depend on the budget).

Level 2 (:class:`kvsim.policies.base.Policy`): the full protocol, for policies that update
their tiers while decoding, recall from CPU or select per layer (H2O, WnW, ArkVale, Quest).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import (
    TIER_GONE,
    TIER_GPU,
    Policy,
    PolicyContext,
    PrefillView,
    descending_ranks,
    topk_from_ranks,
)

__all__ = ["ScoringPolicy", "keep_top"]


def keep_top(ranks: np.ndarray, budgets: np.ndarray | int) -> np.ndarray:
    """Tiers (L, H_kv, T_a) uint8: GPU for the ``budgets`` best-ranked positions of every
    (layer, KV-head) (``budgets`` broadcast to (L, H_kv)), GONE for the rest."""
    keep = topk_from_ranks(ranks, budgets)
    return np.where(keep, TIER_GPU, TIER_GONE)


@dataclass
class ScoringPolicy(Policy):
    """A prefill-only policy defined by a per-position score: each (layer, KV-head) keeps its
    highest-scoring audio positions (ties to the earlier position), the rest is GONE.

    Subclasses are dataclasses (fields = hyperparameters) with a ``name`` and implement
    :meth:`score`. Not ``recallable``, reads no step attention, selects nothing per layer.
    """

    @abc.abstractmethod
    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Importance of every audio position, float array (L, H_kv, T_a); higher is kept.

        Must not depend on ``self.budget`` (the ranks may be shared across budgets)."""

    def head_budgets(self, ctx: PolicyContext, view: PrefillView) -> int | np.ndarray:
        """Positions kept per (layer, KV-head): an int or an int array broadcastable to
        (L, H_kv), each in [0, T_a]. Default ``floor(r * T_a)`` for every head (WnW §3.3)."""
        return uniform_head_budget(ctx, self.budget)

    def ranks(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Rank of every position by descending :meth:`score` (0 = best, ties to the earlier
        position). Override to memoise them per prefill view (see ``base.shared``)."""
        return descending_ranks(self._checked_scores(ctx, view))

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        shape = (ctx.heads.n_layers, ctx.heads.n_kv_heads)
        budgets = self._checked_budgets(ctx, self.head_budgets(ctx, view), shape)
        ranks = self.ranks(ctx, view)
        if ranks.shape != (*shape, ctx.n_audio):
            raise ValueError(f"{self.name}: ranks have shape {ranks.shape}, "
                             f"expected (L, H_kv, T_a)={(*shape, ctx.n_audio)}")
        self._capacity = int(np.broadcast_to(budgets, shape).sum())
        return keep_top(ranks, budgets)

    def gpu_capacity(self) -> int | None:
        return getattr(self, "_capacity", None)

    def _checked_scores(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        scores = np.asarray(self.score(ctx, view))
        want = (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio)
        if scores.shape != want:
            raise ValueError(f"{self.name}: score() returned shape {scores.shape}, "
                             f"expected (L, H_kv, T_a)={want}")
        if not np.issubdtype(scores.dtype, np.number) or np.isnan(scores).any():
            raise ValueError(f"{self.name}: score() must return real numbers without NaN")
        return scores

    def _checked_budgets(self, ctx: PolicyContext, budgets: int | np.ndarray,
                         shape: tuple[int, int]) -> np.ndarray:
        arr = np.asarray(budgets)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{self.name}: head_budgets() must return integers, got {arr.dtype}")
        try:
            np.broadcast_to(arr, shape)
        except ValueError:
            raise ValueError(f"{self.name}: head_budgets() shape {arr.shape} does not "
                             f"broadcast to (L, H_kv)={shape}") from None
        if arr.size and (arr.min() < 0 or arr.max() > ctx.n_audio):
            raise ValueError(f"{self.name}: head_budgets() must lie in [0, T_a={ctx.n_audio}]")
        return arr
