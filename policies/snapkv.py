"""SnapKV (Li et al., 2024): observation-window voting, pooling, per-head top-k at prefill.

Scores each audio position by the attention it receives from the last ``window`` prompt
queries (summed over the GQA group), smooths with a pooling kernel so that neighbours of a hit
are kept (SnapKV §4.2 "clustering"), and keeps the top ``floor(r * T_a)`` per (layer, KV-head).
The set is fixed for the whole decode (no recall): prefill-only compression.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._params import POOLINGS, require_choice, require_int
from kvsim.policies._scoring import pooled_window_scores
from kvsim.policies.base import PolicyContext, PrefillView
from kvsim.policies.registry import register
from kvsim.policies.scoring import ScoringPolicy


@register
@dataclass
class SnapKV(ScoringPolicy):
    """Prefill-only top-k of pooled observation-window attention.

    Parameters
    ----------
    window : int
        Observation-window length, last prompt queries (32: the SnapKV reference code's
        ``init_snapkv`` default ``window_size = 32``; NVIDIA kvpress's ``SnapKVPress`` uses 64).
    kernel : int
        Pooling kernel size (7: WnW App. F's kernel for Ada-KV, which scores with SnapKV, so
        that ``snapkv`` and ``adakv`` differ only in allocation and pooling). Deliberately
        not the SnapKV reference code's and kvpress's ``kernel_size = 5``; pass ``kernel=5``
        for theirs.
    pooling : str
        ``"avg"`` (the SnapKV reference code's ``avgpool``, also kvpress's) or ``"max"``.

    Scope: kvpress pools and selects over the whole prompt (minus the window); here only the
    audio span is scored and compressed (WnW §3.3), the text is always kept.
    """

    name = "snapkv"
    paper = "Li et al., SnapKV: LLM Knows What You Are Looking For Before Generation, NeurIPS 2024"

    window: int = 32
    kernel: int = 7
    pooling: str = "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "window", self.window, lo=1)
        require_int(n, "kernel", self.kernel, lo=1)
        require_choice(n, "pooling", self.pooling, POOLINGS)

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        return pooled_window_scores(ctx, view, self.window, self.kernel, self.pooling)[0]

    def ranks(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        # computed once per prefill view for every budget (and for pyramidkv with the same
        # window, kernel and pooling)
        return pooled_window_scores(ctx, view, self.window, self.kernel, self.pooling)[1]
