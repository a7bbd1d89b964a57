"""AudioKV (Wang et al., 2026) as specified by WnW §3.3 and App. F, audio span only.

The WnW paper gives only the outline ("voice-score-guided per-head budget with FFT smoothing")
and the hyperparameters (α = 0.5, ρ = 0.7, observation window 32, baseline ratio 0.5). Our
reading, written down so it can be checked and changed:

Per-head budget (SparseMM-style allocation, from which AudioKV's voice score derives)
    The total audio budget ``B = floor(r · L · H_kv · T_a)`` is split over all L·H_kv heads:
    a fraction ``baseline_ratio`` uniformly, the rest proportionally to the head's voice score
    VS (normalised to sum to one over heads). Budgets are capped at T_a (overflow re-spread
    proportionally) and rounded by largest remainder, so they sum to B exactly:
    ``b_i ≈ B · (baseline_ratio / (L·H_kv) + (1 - baseline_ratio) · VS_i / Σ VS)``.
Scores (Spectral Score Smoothing)
    ``s`` = SnapKV observation-window attention (last ``window`` queries, summed over the
    window and the GQA group). The FFT low-pass keeps the lowest fraction ``rho`` of the rFFT
    bins along the audio axis (DC included) and inverts: ``s_smooth``. The selection score is
    ``α · s_smooth + (1 - α) · s`` (``alpha`` weights the smoothed trend against the raw
    peaks). Each head keeps its top ``b_i``. Prefill-only: the rest is GONE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._allocation import allocate, fft_lowpass
from kvsim.policies._params import require_int, require_real
from kvsim.policies._scoring import window_scores
from kvsim.policies.base import PolicyContext, PrefillView, descending_ranks, shared
from kvsim.policies.registry import register
from kvsim.policies.scoring import ScoringPolicy


def voice_guided_budgets(
    total: int, voice_score: np.ndarray, n_audio: int, baseline_ratio: float
) -> np.ndarray:
    """Per-head budgets: ``baseline_ratio`` uniform + the rest ∝ VS; sum == total, each <= T_a."""
    vs = np.asarray(voice_score, dtype=np.float64)
    n = vs.size
    vs_share = vs / vs.sum() if vs.sum() > 0 else np.full(vs.shape, 1.0 / n)
    weights = baseline_ratio / n + (1.0 - baseline_ratio) * vs_share
    return allocate(total, weights, n_audio)


def spectral_smooth(scores: np.ndarray, alpha: float, rho: float) -> np.ndarray:
    """``alpha · lowpass_rho(scores) + (1 - alpha) · scores`` along the last axis."""
    return alpha * fft_lowpass(scores, rho) + (1.0 - alpha) * np.asarray(scores, np.float64)


@register
@dataclass
class AudioKV(ScoringPolicy):
    """Voice-score-guided per-head budget with FFT-smoothed SnapKV scores (needs head scores).

    Parameters
    ----------
    alpha : float
        Weight of the FFT-smoothed score in the mix (WnW App. F: 0.5).
    rho : float
        Fraction of rFFT frequency bins kept by the low-pass (WnW App. F: 0.7).
    window : int
        Observation-window queries (WnW App. F: 32).
    baseline_ratio : float
        Fraction of the budget split uniformly over heads (WnW App. F: 0.5).
    """

    name = "audiokv"
    paper = "Wang et al., AudioKV: KV Cache Eviction in Efficient Large Audio Language Models, 2026; WnW §3.3, App. F"

    alpha: float = 0.5
    rho: float = 0.7
    window: int = 32
    baseline_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_real(n, "alpha", self.alpha, lo=0, hi=1)
        require_real(n, "rho", self.rho, lo=0, hi=1, lo_open=True)
        require_int(n, "window", self.window, lo=1)
        require_real(n, "baseline_ratio", self.baseline_ratio, lo=0, hi=1)

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """FFT-smoothed observation-window scores (Spectral Score Smoothing)."""
        return spectral_smooth(window_scores(ctx, view, self.window), self.alpha, self.rho)

    def ranks(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        # of the smoothed scores; they do not depend on the budget: once per prefill view
        return shared(view, ("audiokv", self.window, self.alpha, self.rho),
                      lambda: descending_ranks(self.score(ctx, view)))

    def head_budgets(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Voice-score-guided budgets (L, H_kv) summing to ``floor(r * L * H_kv * T_a)``."""
        hs = ctx.require_head_scores(self.name)
        total = ctx.budget_tokens(self.budget)
        self.head_budgets_ = voice_guided_budgets(total, hs.voice_score, ctx.n_audio,
                                                  self.baseline_ratio)
        return self.head_budgets_
