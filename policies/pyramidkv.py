"""PyramidKV (Cai et al., 2025): pyramidal layer budgets + SnapKV selection within each layer.

Layer budgets decrease arithmetically from the first to the last layer with the same total as
a uniform allocation (PyramidKV §3.2, "pyramidal information funneling"). With the average
per-head budget ``b = floor(r · T_a)`` and PyramidKV's ``beta``: the last layer gets
``b_min = b / beta``, the first ``b_max = 2b - b_min``, and layer ``l`` gets
``b_max - l · (b_max - b_min) / (L - 1)`` (the reference implementation's schedule; beta = 20
there). Larger ``beta`` means a steeper pyramid. When ``b_max`` would exceed T_a the
reference sets ``b_max = T_a`` and ``b_min = 2b - T_a`` (still linear, same total); we do the
same. The reference floors the per-layer step, which loses a few tokens; we round the linear
budgets by largest remainder so that ``Σ_l b_l = L · b`` exactly (measured r_GPU = uniform).
Within a layer every KV-head keeps its top ``b_l`` by SnapKV's pooled observation-window score.
Prefill-only (GONE, no recall); audio span only, so "the window" of text is never evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._allocation import allocate
from kvsim.policies._params import require_real
from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import PolicyContext, PrefillView
from kvsim.policies.registry import register
from kvsim.policies.snapkv import SnapKV


def pyramid_layer_budgets(per_head: int, n_layers: int, n_audio: int, beta: float) -> np.ndarray:
    """Per-layer (per-head) budgets: arithmetic decrease, total ``n_layers · per_head``."""
    if n_layers == 1:
        return np.array([min(per_head, n_audio)], dtype=np.int64)
    b_min = per_head / beta
    b_max = 2.0 * per_head - b_min
    if b_max >= n_audio:  # the reference clips the top layer to the length, same total
        b_max = float(n_audio)
        b_min = 2.0 * per_head - b_max
    raw = b_max - np.arange(n_layers) * (b_max - b_min) / (n_layers - 1)
    return allocate(n_layers * per_head, raw, n_audio)


@register
@dataclass
class PyramidKV(SnapKV):
    """Pyramidal per-layer budget, SnapKV-style top-k inside each layer.

    Parameters
    ----------
    beta : float
        Ratio b_mean / b_min of the pyramid (the PyramidKV reference code's ``beta = 20``);
        must be >= 1 (beta = 1 is a flat, SnapKV-like allocation).
    window : int
        Observation-window queries (32, as for ``snapkv``; the PyramidKV reference code's
        ``PyramidKVCluster`` default is 64). Deliberately shared with ``snapkv`` so that the
        two differ only in the layer allocation.
    kernel : int
        Pooling kernel (7, as for ``snapkv``; the PyramidKV reference default is 5).
    pooling : str
        ``"avg"`` (the reference's ``avgpool``) or ``"max"``.
    """

    name = "pyramidkv"
    paper = "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling, 2025 (§3)"

    beta: float = 20.0  # after SnapKV's window, kernel, pooling (same defaults)

    def __post_init__(self) -> None:
        super().__post_init__()  # SnapKV's checks of window, kernel, pooling
        require_real(self.name, "beta", self.beta, lo=1)

    def head_budgets(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """The pyramid: per-layer budgets (L, 1), the same for every KV-head of a layer."""
        per_head = uniform_head_budget(ctx, self.budget)
        self.layer_budgets_ = pyramid_layer_budgets(per_head, ctx.heads.n_layers, ctx.n_audio,
                                                    self.beta)
        return self.layer_budgets_[:, None]
