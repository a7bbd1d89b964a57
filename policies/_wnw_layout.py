"""WnW building blocks: segment/chunk geometry, head triage, eq. (1) retention and its λ solve.

Kept apart from :mod:`kvsim.policies.wnw` so each piece can be unit-tested on hand-made inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Head roles (WnW §2.2).
FIXED, TIDAL, ANCHOR = 0, 1, 2

#: n_voice / (L*H_kv) used by the paper at r_GPU = 0.2, 0.4, 0.6, 0.8 (§3.4: {90,50,30,30} of
#: 240 heads on Voxtral, {27,15,9,9} of 72 on Qwen2.5-Omni: the same fractions).
PAPER_VOICE_FRACTION = ((0.2, 90 / 240), (0.4, 50 / 240), (0.6, 30 / 240), (0.8, 30 / 240))


def default_voice_fraction(r_gpu: float) -> float:
    """Fraction of KV-heads that are voice heads when ``n_voice`` is not given.

    Piecewise-linear interpolation of the paper's table (§3.4), constant outside [0.2, 0.8].
    """
    xs = [r for r, _ in PAPER_VOICE_FRACTION]
    ys = [f for _, f in PAPER_VOICE_FRACTION]
    return float(np.interp(r_gpu, xs, ys))


@dataclass(frozen=True)
class SegmentLayout:
    """Segments (stride W_s) and overlapping chunks (W_c) over the audio span (WnW §2.3).

    ``n_s = ceil(W_s * r_tok)`` tokens per segment, ``n_c = ceil(W_c * r_tok)`` per chunk;
    chunk ``c`` covers audio ``[c*n_s, min(c*n_s + n_c, T_a))`` and the segments it overlaps.
    """

    n_audio: int
    n_s: int
    n_c: int

    @classmethod
    def from_seconds(
        cls, n_audio: int, tokens_per_s: float, chunk_seconds: float, stride_seconds: float
    ) -> SegmentLayout:
        if tokens_per_s <= 0:
            raise ValueError(f"audio_tokens_per_s must be > 0, got {tokens_per_s}")
        if not (0 < stride_seconds <= chunk_seconds):
            raise ValueError(
                f"need 0 < stride_seconds <= chunk_seconds, got {stride_seconds}, {chunk_seconds}"
            )
        n_s = max(1, math.ceil(stride_seconds * tokens_per_s - 1e-9))
        n_c = max(n_s, math.ceil(chunk_seconds * tokens_per_s - 1e-9))
        return cls(n_audio=n_audio, n_s=n_s, n_c=n_c)

    @property
    def n_segments(self) -> int:
        return max(1, math.ceil(self.n_audio / self.n_s))

    @property
    def seg_bounds(self) -> np.ndarray:
        """(n_segments, 2) start/end audio index of each segment."""
        starts = np.arange(self.n_segments) * self.n_s
        return np.stack([starts, np.minimum(starts + self.n_s, self.n_audio)], axis=1)

    @property
    def seg_len(self) -> np.ndarray:
        b = self.seg_bounds
        return b[:, 1] - b[:, 0]

    @property
    def seg_of_pos(self) -> np.ndarray:
        """Segment index of every audio position, shape (T_a,)."""
        return np.arange(self.n_audio) // self.n_s

    @property
    def n_chunks(self) -> int:
        if self.n_audio <= self.n_c:
            return 1
        return math.ceil((self.n_audio - self.n_c) / self.n_s) + 1

    @property
    def chunk_bounds(self) -> np.ndarray:
        """(n_chunks, 2) start/end audio index of each chunk."""
        starts = np.arange(self.n_chunks) * self.n_s
        return np.stack([starts, np.minimum(starts + self.n_c, self.n_audio)], axis=1)

    def chunk_segments(self, c: int) -> range:
        """Segments overlapped by chunk ``c`` (load/evict granularity, §2.3)."""
        start, end = self.chunk_bounds[c]
        return range(int(start) // self.n_s, math.ceil(int(end) / self.n_s))

    def chunk_scores(self, position_scores: np.ndarray) -> np.ndarray:
        """Mean of a per-position score over each chunk (§2.3 dynamic chunk selection)."""
        csum = np.concatenate([[0.0], np.cumsum(position_scores, dtype=np.float64)])
        b = self.chunk_bounds
        return (csum[b[:, 1]] - csum[b[:, 0]]) / (b[:, 1] - b[:, 0])


def triage(
    importance: np.ndarray, n_voice: int, n_anchor: int
) -> np.ndarray:
    """Head roles from the importance ranking over all L*H_kv heads (§2.2, two nested steps).

    The top ``n_voice`` heads are voice heads, the top ``n_anchor`` of those are anchors, the
    other voice heads tidal, the rest fixed. Ties go to the lower (layer, head) index.
    Returns an int8 (L, H_kv) array of FIXED / TIDAL / ANCHOR.
    """
    flat = np.asarray(importance, dtype=np.float64).ravel()
    order = np.argsort(-flat, kind="stable")
    roles = np.full(flat.shape, FIXED, dtype=np.int8)
    n_voice = min(n_voice, flat.size)
    n_anchor = min(n_anchor, n_voice)
    roles[order[:n_voice]] = TIDAL
    roles[order[:n_anchor]] = ANCHOR
    return roles.reshape(np.shape(importance))


def normalised_importance(importance: np.ndarray) -> np.ndarray:
    """s̃ in [0, 1]: importance divided by its maximum over all heads (all ones if all zero)."""
    imp = np.asarray(importance, dtype=np.float64)
    top = imp.max() if imp.size else 0.0
    return imp / top if top > 0 else np.ones_like(imp)


def retention(s_tilde: np.ndarray, lam: float) -> np.ndarray:
    """Eq. (1): retention_i = min(s̃_i * λ, 1)."""
    return np.minimum(np.asarray(s_tilde, dtype=np.float64) * lam, 1.0)


def kept_per_segment(
    ret: np.ndarray, seg_len: np.ndarray, min_per_segment: int
) -> np.ndarray:
    """Per-(head, segment) GPU quota ⌊retention · n_s⌋ (§2.3), at least ``min_per_segment``
    (0 = the paper's formula, which may keep nothing of a segment).

    ``ret`` has shape (n_heads,); returns int64 (n_heads, n_segments), never above a segment's
    length (the last segment may be shorter than n_s).
    """
    raw = np.floor(ret[:, None] * seg_len[None, :] + 1e-9).astype(np.int64)
    return np.minimum(np.maximum(raw, min_per_segment), seg_len[None, :])


@dataclass(frozen=True)
class SolveResult:
    """Outcome of the λ solve (§3.4)."""

    lam: float
    prefill_gpu: int  #: GPU audio tokens right after prefill (anchors included)
    reserve: int  #: recall headroom kept free inside the budget
    saturated: bool  #: λ large enough that every non-anchor head keeps everything


def solve_lambda(
    s_tilde: np.ndarray,
    roles: np.ndarray,
    seg_len: np.ndarray,
    budget_tokens: int,
    reserve_segments: int,
    min_per_segment: int,
    tol: float = 1e-7,
) -> SolveResult:
    """Largest λ with  prefill_gpu(λ) + reserve(λ) <= budget_tokens  (bisection).

    ``prefill_gpu(λ)`` = T_a per anchor + Σ over non-anchor heads and segments of the eq. (1)
    quota; ``reserve(λ)`` = Σ of the ``reserve_segments`` largest per-segment recall costs
    (positions a recall moves CPU->GPU summed over tidal heads). The sum is non-decreasing
    in λ (a tidal head's kept tokens grow at least as fast as its recall cost shrinks), so
    bisection finds the boundary. If even λ = 0 does not fit, λ = 0 is returned and the
    caller must check ``prefill_gpu <= budget_tokens``.
    """
    s = np.asarray(s_tilde, dtype=np.float64).ravel()
    r = np.asarray(roles).ravel()
    n_audio = int(seg_len.sum())
    non_anchor = r != ANCHOR
    tidal = r == TIDAL
    anchors_total = int((r == ANCHOR).sum()) * n_audio

    def evaluate(lam: float) -> tuple[int, int]:
        kept = kept_per_segment(retention(s[non_anchor], lam), seg_len, min_per_segment)
        prefill = anchors_total + int(kept.sum())
        cost = (seg_len[None, :] - kept)[tidal[non_anchor]].sum(axis=0)
        m = min(reserve_segments, cost.size)
        reserve = int(np.sort(cost)[::-1][:m].sum()) if m > 0 else 0
        return prefill, reserve

    pos = s[non_anchor][s[non_anchor] > 0]
    lam_hi = 1.0 / pos.min() if pos.size else 1.0
    p_hi, r_hi = evaluate(lam_hi)
    if p_hi + r_hi <= budget_tokens:
        return SolveResult(lam_hi, p_hi, r_hi, True)
    lo, hi = 0.0, lam_hi
    while hi - lo > tol * lam_hi:
        mid = 0.5 * (lo + hi)
        p, res = evaluate(mid)
        if p + res <= budget_tokens:
            lo = mid
        else:
            hi = mid
    p, res = evaluate(lo)
    return SolveResult(lo, p, res, False)


def count_prefill_gpu(
    s_tilde: np.ndarray, roles: np.ndarray, seg_len: np.ndarray, lam: float, min_per_segment: int
) -> int:
    """GPU audio tokens after prefill for an explicit λ (anchors keep all of T_a)."""
    s = np.asarray(s_tilde, dtype=np.float64).ravel()
    r = np.asarray(roles).ravel()
    kept = kept_per_segment(retention(s[r != ANCHOR], lam), seg_len, min_per_segment)
    return int((r == ANCHOR).sum()) * int(seg_len.sum()) + int(kept.sum())


def fit_lambda_mean(
    cases: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    target: float,
    min_per_segment: int,
    policy: str = "wnw",
    tol: float = 1e-7,
) -> float:
    """Largest λ whose *mean* prefill retention over ``cases`` is at most ``target`` (§3.4).

    Each case is ``(s_tilde, roles, seg_len)`` of one input; its prefill retention is
    :func:`count_prefill_gpu` / (heads · T_a) (anchors keep all of T_a). With one case this
    is the largest λ whose prefill fits ``floor(target · L · H_kv · T_a)``. The mean is
    non-decreasing in λ, so bisection finds the boundary. Raises ``ValueError`` when even
    λ = 0 (anchors plus the ``min_per_segment`` floor) exceeds the target.
    """
    if not cases:
        raise ValueError(f"{policy}: no calibration inputs to fit λ on")

    def fraction(case: tuple[np.ndarray, np.ndarray, np.ndarray], lam: float) -> float:
        s, roles, seg_len = case
        total = np.asarray(roles).size * int(seg_len.sum())
        return count_prefill_gpu(s, roles, seg_len, lam, min_per_segment) / total

    def fits(lam: float) -> bool:
        return mean(lam) <= target + 1e-12  # float slack only: counts are integers

    def mean(lam: float) -> float:
        return float(np.mean([fraction(c, lam) for c in cases]))

    if not fits(0.0):
        raise ValueError(
            f"{policy}: at λ = 0 the anchors (all of T_a) and the floor of {min_per_segment} "
            f"token(s) per segment already keep {mean(0.0):.4f} of the audio KV, over the "
            f"target r={target:g}; lower n_anchor or min_per_segment, or raise the budget"
        )
    positive = [np.ravel(s)[(np.ravel(r) != ANCHOR) & (np.ravel(s) > 0)] for s, r, _ in cases]
    smallest = min((p.min() for p in positive if p.size), default=1.0)
    lam_hi = 1.0 / smallest
    if fits(lam_hi):
        return lam_hi
    lo, hi = 0.0, lam_hi
    while hi - lo > tol * lam_hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
