"""Integer budget allocation and score smoothing shared by the zoo-a policies.

These helpers turn real-valued shares into integer token budgets that sum *exactly* to a total
(largest-remainder rounding with per-item caps, i.e. water-filling), so that a static policy's
measured r_GPU equals its target up to the floor of ``r * L * H_kv * T_a``.
"""

from __future__ import annotations

import numpy as np


def allocate(total: int, weights: np.ndarray, cap: int | np.ndarray) -> np.ndarray:
    """Split ``total`` integer tokens over items proportionally to ``weights``, each <= ``cap``.

    Items that would exceed their cap are clipped and their excess is re-spread over the
    others in proportion to their weights (water-filling); the final fractional shares are
    rounded by largest remainder (ties to the lower index). The result sums to
    ``min(total, sum(cap))``.

    Parameters
    ----------
    total : int
        Tokens to distribute (>= 0).
    weights : np.ndarray
        Non-negative weights, any shape. All-zero weights mean a uniform split.
    cap : int or np.ndarray
        Per-item maximum (broadcast to ``weights``).

    Returns
    -------
    np.ndarray
        int64 array with the shape of ``weights``.
    """
    w = np.asarray(weights, dtype=np.float64)
    shape = w.shape
    w = w.ravel().copy()
    caps = np.broadcast_to(np.asarray(cap, dtype=np.int64), shape).ravel().astype(np.int64)
    if total < 0:
        raise ValueError(f"allocate: total must be >= 0, got {total}")
    if (w < 0).any() or not np.isfinite(w).all():
        raise ValueError("allocate: weights must be finite and non-negative")
    total = int(min(total, int(caps.sum())))
    if w.sum() <= 0:
        w = np.ones_like(w)
    w = np.where(caps > 0, w, 0.0)
    if w.sum() <= 0:  # only zero-weight items have room: spread uniformly over them
        w = (caps > 0).astype(np.float64)
    share = np.zeros_like(w)
    free = caps > 0
    remaining = float(total)
    # Water-filling: clip items whose proportional share exceeds their cap, repeat.
    while remaining > 1e-12 and free.any():
        wf = np.where(free, w, 0.0)
        if wf.sum() <= 0:
            wf = free.astype(np.float64)
        prop = remaining * wf / wf.sum()
        over = free & (share + prop >= caps)
        if not over.any():
            share = share + prop
            break
        remaining -= float((caps[over] - share[over]).sum())
        share[over] = caps[over]
        free &= ~over
    base = np.minimum(np.floor(share + 1e-9).astype(np.int64), caps)
    left = total - int(base.sum())
    if left > 0:
        frac = np.where(base < caps, share - base, -np.inf)
        order = np.argsort(-frac, kind="stable")
        room = order[base[order] < caps[order]]
        base[room[:left]] += 1
    return base.reshape(shape)


def fft_lowpass(scores: np.ndarray, keep_fraction: float) -> np.ndarray:
    """Low-pass filter along the last axis: keep the lowest ``keep_fraction`` of rFFT bins.

    The DC bin is always kept, so the mean of each row is preserved. ``keep_fraction=1``
    returns the input unchanged (up to float error).
    """
    if not (0.0 < keep_fraction <= 1.0):
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    x = np.asarray(scores, dtype=np.float64)
    n = x.shape[-1]
    if n < 2:
        return x.copy()
    spec = np.fft.rfft(x, axis=-1)
    n_bins = spec.shape[-1]
    keep = max(1, int(np.ceil(keep_fraction * n_bins - 1e-9)))
    spec[..., keep:] = 0.0
    return np.fft.irfft(spec, n=n, axis=-1)
