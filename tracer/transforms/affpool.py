"""AffPool: merge adjacent audio tokens whose embeddings are alike.

Affinity of two adjacent audio tokens is the cosine similarity of their embeddings. One pass
scans left to right: a group grows by the next token while the edge to it has affinity
``>= threshold`` and the group has fewer than ``window`` (3) tokens; each group is
average-pooled into one token (order preserved). In one pass the number of groups is
non-increasing as the threshold falls (merging runs of lengths a, b gives
ceil((a+b)/w) <= ceil(a/w) + ceil(b/w)).

WnW (Appendix, baselines) applies AffPool as *deep* pooling, window 3 at each of the first 27
layers, so merging compounds across layers and retentions below 1/3 are reachable; here it acts
on the input embeddings (kvsim's input transforms), so the compounding is reproduced with
successive passes: the fewest passes that can reach the target (one for r >= 1/3, two down to
1/9, ...), one threshold for all passes, found by bisection to hit the target retention (the
paper reports measured retention within two points of the target; the tests check the same).
Final tokens are means of the original embeddings of each merged range.
"""

from __future__ import annotations

import numpy as np
import torch

from kvsim.tracer.transforms.base import SpanTransform


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


def _pool(embeds: torch.Tensor, source: list[tuple[int, int]], threshold: float, window: int):
    """One pooling pass over the current sequence; ``source`` maps it to original indices."""
    groups = groups_for(adjacent_affinity(embeds), threshold, window) if embeds.shape[0] > 1 else [(0, 1)]
    pooled = torch.stack([embeds[a:b].mean(0) for a, b in groups])
    return pooled, [(source[a][0], source[b - 1][1]) for a, b in groups]


def passes_for(retention: float, window: int = 3) -> int:
    """Fewest window-``w`` passes that can reach ``retention`` (each keeps >= 1/w)."""
    if window < 2:
        raise ValueError(f"affpool: window must be >= 2, got {window}")
    if retention <= 0:
        raise ValueError(f"affpool: retention must be > 0, got {retention}")
    p = 1
    while window ** (-p) > retention + 1e-12:
        p += 1
    return p


def pool_passes(embeds: torch.Tensor, threshold: float, window: int, passes: int):
    """``passes`` successive pooling passes with one threshold (deep pooling's compounding,
    applied to the input sequence). Returns (pooled, source ranges in original indices)."""
    e = embeds.detach().float()
    source = [(i, i + 1) for i in range(e.shape[0])]
    for _ in range(passes):
        e, source = _pool(e, source, threshold, window)
    # pool the original embeddings over the final ranges (means of means would weight unevenly)
    out = torch.stack([embeds[a:b].mean(0) for a, b in source])
    return out, source


def calibrate_threshold(embeds: torch.Tensor, retention: float, window: int = 3,
                        passes: int | None = None, iters: int = 40) -> tuple[float, int]:
    """(threshold, passes) whose pooling keeps the token fraction closest to ``retention``:
    bisection on the threshold (fewer tokens kept as it falls), with the fewest passes that can
    reach the target."""
    n = embeds.shape[0]
    passes = passes or passes_for(retention, window)
    lo_r = len(pool_passes(embeds, -2.0, window, passes)[1]) / n
    if not (lo_r - 1e-9 <= retention <= 1.0):
        raise ValueError(f"affpool: retention {retention} is outside [{lo_r:.3f}, 1] "
                         f"for window {window} and {passes} pass(es)")

    def ret(t: float) -> float:
        return len(pool_passes(embeds, t, window, passes)[1]) / n

    lo, hi = -1.0 - 1e-6, 1.0 + 1e-6  # ret(lo) = lowest, ret(hi) = 1
    best_t, best_err = hi, abs(1.0 - retention)
    for _ in range(iters):
        mid = (lo + hi) / 2
        r = ret(mid)
        if abs(r - retention) < best_err:
            best_t, best_err = mid, abs(r - retention)
        if r >= retention:
            hi = mid
        else:
            lo = mid
    for t in (lo, hi):
        if abs(ret(t) - retention) < best_err:
            best_t, best_err = t, abs(ret(t) - retention)
    return best_t, passes


def affpool(embeds: torch.Tensor, start_s: np.ndarray, end_s: np.ndarray, retention: float = 0.5,
            window: int = 3, threshold: float | None = None, passes: int | None = None) -> SpanTransform:
    """Pool adjacent similar audio tokens (see module docstring) to about ``retention``."""
    n = embeds.shape[0]
    if n < 2:
        return SpanTransform(embeds, ["audio"] * n, np.asarray(start_s), np.asarray(end_s),
                             [(i, i + 1) for i in range(n)])
    if threshold is None:
        threshold, passes = calibrate_threshold(embeds, retention, window, passes)
    pooled, groups = pool_passes(embeds, threshold, window, passes or 1)
    return SpanTransform(
        embeds=pooled.to(embeds.dtype), kinds=["audio"] * len(groups),
        start_s=np.array([start_s[a] for a, _ in groups]), end_s=np.array([end_s[b - 1] for _, b in groups]),
        source=groups,
    )
