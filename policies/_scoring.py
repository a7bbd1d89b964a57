"""Shared prefill scoring helpers: observation-window attention, pooling, per-head budgets."""

from __future__ import annotations

import numpy as np
from scipy.ndimage import maximum_filter1d, uniform_filter1d

from kvsim.policies.base import PolicyContext, PrefillView, descending_ranks, kv_group_sum, shared


def window_scores(ctx: PolicyContext, view: PrefillView, window: int | None = None) -> np.ndarray:
    """Observation-window attention mass per audio position, per KV-head.

    Sums the full-model attention of the last ``window`` observation queries (all when None)
    over the window and the GQA group (SnapKV §3, "voting"). Shape (L, H_kv, T_a), float64.

    The result is read-only: a view with a ``memo`` (the replay engine's, shared by every
    policy of a run) computes it once per ``window``; copy it before changing it.
    """
    n_window = view.n_window
    if window is None or window > n_window:
        window = n_window

    def compute() -> np.ndarray:
        g = ctx.heads.group
        out = np.empty((ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio), dtype=np.float64)
        for layer in range(ctx.heads.n_layers):
            # no reference to a layer's attention outlives its line: the view frees it before
            # computing the next layer
            per_q = window_mass(view.audio_attention(layer), window)  # (H_q, T_a)
            out[layer] = kv_group_sum(per_q, g)
        out.flags.writeable = False
        return out

    return shared(view, ("window_scores", window), compute)


def window_mass(att: np.ndarray, window: int) -> np.ndarray:
    """(H_q, T_a) float64: one layer's (H_q, W, T_a) window attention summed over its last
    ``window`` queries."""
    if window < att.shape[1]:
        att = att[:, -window:, :]
    return att.sum(axis=1, dtype=np.float64)


def pooled_window_scores(
    ctx: PolicyContext, view: PrefillView, window: int | None, kernel: int, kind: str
) -> tuple[np.ndarray, np.ndarray]:
    """SnapKV's pooled observation-window scores (:func:`window_scores` then
    :func:`pool_scores`), (L, H_kv, T_a), and their :func:`descending_ranks`.

    Both are read-only and computed once per prefill view with a ``memo`` and parameters, for
    every policy and budget that selects from them (``topk_mask(scores, k)`` is
    ``topk_from_ranks(ranks, k)``).
    """
    def compute() -> tuple[np.ndarray, np.ndarray]:
        scores = np.array(pool_scores(window_scores(ctx, view, window), kernel, kind))
        ranks = descending_ranks(scores)
        scores.flags.writeable = False
        ranks.flags.writeable = False
        return scores, ranks

    return shared(view, ("pooled_window_scores", window, kernel, kind), compute)


def pool_scores(scores: np.ndarray, kernel: int, kind: str = "avg") -> np.ndarray:
    """Pool scores along the position axis with a centred window (SnapKV's clustering step)."""
    if kernel <= 1:
        return scores
    if kind == "max":
        return maximum_filter1d(scores, size=kernel, axis=-1, mode="nearest")
    if kind == "avg":
        return uniform_filter1d(scores, size=kernel, axis=-1, mode="nearest")
    raise ValueError(f"pooling must be 'avg' or 'max', got {kind!r}")


def uniform_head_budget(ctx: PolicyContext, r_gpu: float) -> int:
    """Per-(layer, KV-head) audio budget floor(r * T_a) (the audio-only scope of WnW §3.3)."""
    return int(np.floor(r_gpu * ctx.n_audio + 1e-9))
