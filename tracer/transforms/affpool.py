"""AffPool: merge adjacent audio tokens whose embeddings are alike.

Affinity of two adjacent audio tokens is the cosine similarity of their input embeddings.
Scanning left to right, a group grows by the next token while the edge to it has affinity
``>= threshold`` and the group has fewer than ``window`` (3) tokens; each group is
average-pooled into one token (order preserved). The number of groups is non-increasing as the
threshold falls (merging two runs of lengths a, b gives ceil((a+b)/w) <= ceil(a/w)+ceil(b/w)),
so the threshold that hits a target retention is found by bisection over the observed
affinities; each flipped edge changes the count by at most one token, so the target is met to
within 1/n.
"""

from __future__ import annotations

import numpy as np
import torch

from tracer.transforms.base import SpanTransform


def adjacent_affinity(embeds: torch.Tensor) -> np.ndarray:
    """Cosine similarity of consecutive rows, shape (n - 1,)."""
    e = embeds.detach().float()
    return torch.nn.functional.cosine_similarity(e[:-1], e[1:], dim=-1).cpu().numpy()


def groups_for(affinity: np.ndarray, threshold: float, window: int = 3) -> list[tuple[int, int]]:
    """Greedy left-to-right groups [start, end) of at most ``window`` tokens joined by edges
    with affinity >= threshold."""
    n = len(affinity) + 1
    out, start = [], 0
    for i in range(1, n):
        if affinity[i - 1] >= threshold and i - start < window:
            continue
        out.append((start, i))
        start = i
    out.append((start, n))
    return out


def calibrate_threshold(affinity: np.ndarray, retention: float, window: int = 3) -> float:
    """Threshold whose grouping keeps the token fraction closest to ``retention`` (bisection
    over the sorted distinct affinities; retention is monotone in the threshold)."""
    n = len(affinity) + 1
    lo_r = int(np.ceil(n / window)) / n
    if not (lo_r - 1e-9 <= retention <= 1.0):
        raise ValueError(f"affpool: retention {retention} is outside [{lo_r:.3f}, 1] for window {window}")
    cands = np.concatenate([np.unique(affinity), [np.inf]])  # ascending; inf keeps everything

    def ret(i: int) -> float:
        return len(groups_for(affinity, float(cands[i]), window)) / n

    lo, hi = 0, len(cands) - 1  # ret(lo) smallest, ret(hi) = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ret(mid) >= retention:
            hi = mid
        else:
            lo = mid
    best = min((lo, hi), key=lambda i: abs(ret(i) - retention))
    return float(cands[best])


def affpool(embeds: torch.Tensor, start_s: np.ndarray, end_s: np.ndarray, retention: float = 0.5,
            window: int = 3, threshold: float | None = None) -> SpanTransform:
    """Pool adjacent similar audio tokens (see module docstring) to about ``retention``."""
    n = embeds.shape[0]
    if n < 2:
        return SpanTransform(embeds, ["audio"] * n, np.asarray(start_s), np.asarray(end_s),
                             [(i, i + 1) for i in range(n)])
    aff = adjacent_affinity(embeds)
    thr = calibrate_threshold(aff, retention, window) if threshold is None else threshold
    groups = groups_for(aff, thr, window)
    pooled = torch.stack([embeds[a:b].mean(0) for a, b in groups])
    return SpanTransform(
        embeds=pooled, kinds=["audio"] * len(groups),
        start_s=np.array([start_s[a] for a, _ in groups]), end_s=np.array([end_s[b - 1] for _, b in groups]),
        source=groups,
    )
