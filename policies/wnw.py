"""WnW: Waxing-and-Waning KV cache (WnW paper §2.2–2.3, §3.4, §3.8).

Head triage (§2.2)
    KV-heads are ranked by the triage signal (VS×HS by default; A3 ablation: VS or HS only).
    The top ``n_voice`` are voice heads; the top ``n_anchor`` of those are **anchors** (all
    audio on GPU, retention 1), the other voice heads are **tidal** (GPU subset + CPU
    complement, recallable), the rest are **fixed** (GPU subset, the rest GONE).
Retention (eq. 1)
    ``retention_i = min(s̃_i · λ, 1)`` for tidal and fixed heads, ``s̃ = importance / max``.
Prefill compression (§2.3, A2 ablation)
    Each non-anchor head ranks audio positions by ``p^prefill`` = attention of every
    observation-window query summed over the window and the GQA group, and keeps the top
    ``⌊retention · n_s⌋`` of each ``n_s``-token segment (``prefill_selection="segment"``;
    may be 0, see the quota below) or the same total as one global top-k
    (``"global"``).
Decode-time chunk swap (§2.3)
    After each step, eq. (2): ``A_τ = Σ_{anchor (layer, q-head)} softmax(...)_τ`` (anchors see
    all audio, so this is their true attention), reset every step; chunks of ``n_c`` tokens
    with stride ``n_s`` score ``mean_{τ∈c} A_τ``; the ``top_k`` chunks are selected. For tidal
    heads, segments of selected chunks are recalled (CPU->GPU, every position of the segment:
    all non-GPU positions of a tidal head have a CPU copy); a recalled segment unselected for
    ``delta`` consecutive steps is released: its positions outside the prefill subset go back
    to CPU (their copy persists) and the prefill subset stays on GPU — after a release the
    segment is exactly in its post-prefill state (the paper's "starting point" for chunk swap).
    All tidal heads share one segment state (the selection is global). Fixed heads never
    recall; anchors never change.

Budget accounting (§3.4), ``budget_mode``
    ``"paper"`` (default): the paper's words are "we select λ on the calibration set so that
    the measured r_GPU matches each target". λ is a per-target constant, fitted once on a
    calibration set (:func:`kvsim.policies.wnw_calibrate.fit_lambda`, passed as ``lam``); the
    *prefill* retention then sits at the target and recalls come on top of it, so the mean
    measured r_GPU is a little above the target (the paper: 22.25% r_GPU / 41.52% r_GPU+CPU
    at a 0.2 target, WnW Table 5 and Table 2). ``gpu_capacity()`` is the true worst case:
    prefill plus the recall cost of the ``delta · top_k · (segments per chunk)`` most
    expensive segments. Without ``lam`` the policy fits λ on the input itself (largest λ
    whose prefill fits ``B = floor(r · L · H_kv · T_a)``) and warns that this is a per-input
    λ, not the paper's calibration-set λ.
    ``"step"`` (kvsim's variant): B is a hard cap at **every** step. λ is solved so that
    ``prefill_gpu(λ) + reserve(λ) <= B`` where ``reserve`` is the recall headroom of the
    ``reserve_segments`` most expensive segments (default ``2·top_k``); the GPU count then
    oscillates between ``prefill_gpu`` and B (Fig. 4's "slight oscillation"). Recalls that
    would exceed B are granted in chunk-rank order, lagging segments are released early to
    make room, and a selected segment that still does not fit is not recalled that step.
    If no segment can ever be recalled within B, a warning says so.
In both modes, if the λ = 0 state (every anchor's full T_a plus the ``min_per_segment``
floor) exceeds B — with few heads the paper's 5 anchors alone can — anchors are reduced
(then the floor dropped, then anchors go to zero) with a :class:`WnWBudgetWarning` naming
the change, never silently. :func:`kvsim.policies.wnw_calibrate.fit_lambda` raises instead.

Per-segment quota (§2.3): ``⌊retention · n_s⌋`` per (head, segment), which may be 0 (the
paper's formula, ``min_per_segment=0``); ``min_per_segment=1`` is kvsim's at-least-one floor.

The effective values are in ``roles_``, ``lambda_solved_``, ``lam_source_`` and
``min_per_segment_``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from kvsim.policies._params import require_choice, require_int, require_real
from kvsim.policies._scoring import window_scores
from kvsim.policies._wnw_layout import (
    ANCHOR,
    TIDAL,
    SegmentLayout,
    SolveResult,
    count_prefill_gpu,
    default_voice_fraction,
    fit_lambda_mean,
    kept_per_segment,
    normalised_importance,
    retention,
    solve_lambda,
    triage,
)
from kvsim.policies.base import (
    TIER_CPU,
    TIER_GONE,
    TIER_GPU,
    Policy,
    PolicyContext,
    PrefillView,
    StepView,
    topk_mask,
)
from kvsim.policies.registry import register

_SIGNALS = ("vs_hs", "vs", "hs")
_SELECTIONS = ("segment", "global")
_MODES = ("paper", "step")


class WnWBudgetWarning(UserWarning):
    """WnW ran with something other than the paper's configuration (named in the message)."""


@register
@dataclass
class WnW(Policy):
    """Waxing-and-Waning KV cache: anchor / tidal / fixed heads with decode-time chunk swap.

    Parameters
    ----------
    n_voice : int or None
        Voice heads (anchors + tidal). None: ``round(f(r) · L · H_kv)`` with ``f`` the
        paper's fraction {0.375, 0.208, 0.125, 0.125} at r = {0.2, 0.4, 0.6, 0.8} (§3.4:
        n_voice {90, 50, 30, 30} of 240 Voxtral heads), linearly interpolated, constant
        outside.
    n_anchor : int
        Anchor heads (§2.2: "the top n_anchor=5 are designated anchor heads").
    lam : float or None
        Eq. (1) scale λ, fitted per target on a calibration set (§3.4; use
        :func:`kvsim.policies.wnw_calibrate.fit_lambda`). None: fitted on the input itself, with a
        :class:`WnWBudgetWarning` ("per-input λ, not the paper's").
    chunk_seconds, stride_seconds : float
        W_c = 4 s and W_s = 2 s (§2.3 "Chunk Structure"); token counts ``ceil(W · r_tok)``.
    top_k : int
        Chunks selected per decode step (§2.3: "the top-k (k=3) chunks are selected").
    delta : int
        Consecutive unselected steps before a recalled segment is released (§2.3: δ=3).
    prefill_selection : str
        ``"segment"`` (§2.3, WnW) or ``"global"`` top-k with the same total (§3.8 ablation A2).
    triage_signal : str
        ``"vs_hs"`` (§2.2, WnW), ``"vs"`` or ``"hs"`` (§3.8 ablation A3): ranks heads for both
        triage steps and is the importance s̃ normalises in eq. (1).
    min_per_segment : int
        Floor of the per-segment quota: 0 = the paper's ``⌊retention · n_s⌋`` (§2.3), which
        may be 0; 1 = kvsim's at-least-one-per-segment variant.
    budget_mode : str
        ``"paper"`` (§3.4, default) or ``"step"`` (kvsim's hard cap at every step); see the
        module docstring.
    reserve_segments : int or None
        ``"step"`` mode only (kvsim's, no paper value): segments of recall headroom kept
        free in the λ solve; None = ``2 · top_k`` (one step's worth of selected chunks).
    """

    name = "wnw"
    paper = "WnW: Waxing-and-Waning KV Cache for Long-Form Speech LLMs (§2.2-2.3, §3.4, §3.8)"
    recallable = True
    needs_step_attention = True

    n_voice: int | None = None
    n_anchor: int = 5
    lam: float | None = None
    chunk_seconds: float = 4.0
    stride_seconds: float = 2.0
    top_k: int = 3
    delta: int = 3
    prefill_selection: str = "segment"
    triage_signal: str = "vs_hs"
    min_per_segment: int = 0
    budget_mode: str = "paper"
    reserve_segments: int | None = None

    roles_: np.ndarray | None = field(default=None, init=False, repr=False)
    retention_: np.ndarray | None = field(default=None, init=False, repr=False)
    lambda_solved_: float | None = field(default=None, init=False, repr=False)
    lam_source_: str = field(default="", init=False, repr=False)
    min_per_segment_: int = field(default=0, init=False, repr=False)
    solve_: SolveResult | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "n_voice", self.n_voice, lo=0, allow_none=True)
        require_int(n, "n_anchor", self.n_anchor, lo=0)
        require_real(n, "lam", self.lam, lo=0, allow_none=True)
        require_real(n, "chunk_seconds", self.chunk_seconds, lo=0, lo_open=True)
        require_real(n, "stride_seconds", self.stride_seconds, lo=0, hi=self.chunk_seconds,
                     lo_open=True)
        require_int(n, "top_k", self.top_k, lo=1)
        require_int(n, "delta", self.delta, lo=1)
        require_choice(n, "prefill_selection", self.prefill_selection, _SELECTIONS)
        require_choice(n, "triage_signal", self.triage_signal, _SIGNALS)
        require_int(n, "min_per_segment", self.min_per_segment, lo=0)
        require_choice(n, "budget_mode", self.budget_mode, _MODES)
        require_int(n, "reserve_segments", self.reserve_segments, lo=0, allow_none=True)

    # ------------------------------------------------------------------------------ prefill
    def _signal(self, ctx: PolicyContext) -> np.ndarray:
        hs = ctx.require_head_scores(self.name)
        return {
            "vs_hs": hs.importance,
            "vs": hs.voice_score,
            "hs": hs.sensitivity,
        }[self.triage_signal]

    def head_counts(self, n_heads: int) -> tuple[int, int]:
        """(n_voice, n_anchor) for a model with ``n_heads`` = L · H_kv KV-heads."""
        n_voice = (
            int(round(default_voice_fraction(self.budget) * n_heads))
            if self.n_voice is None
            else self.n_voice
        )
        n_voice = min(max(n_voice, 0), n_heads)
        return n_voice, min(self.n_anchor, n_voice)

    def lambda_problem(self, ctx: PolicyContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(s̃, roles, segment lengths) of ``ctx``: all that eq. (1)'s prefill count needs."""
        signal = self._signal(ctx)
        seg_len = SegmentLayout.from_seconds(
            ctx.n_audio, ctx.audio_tokens_per_s, self.chunk_seconds, self.stride_seconds
        ).seg_len
        n_voice, n_anchor = self.head_counts(ctx.heads.n_heads_total)
        return normalised_importance(signal), triage(signal, n_voice, n_anchor), seg_len

    def _plan(self, ctx: PolicyContext, signal: np.ndarray, seg_len: np.ndarray) -> None:
        """Fix roles, the quota floor and λ (see the module docstring, "Budget accounting")."""
        budget = ctx.budget_tokens(self.budget)
        if self.budget_mode == "paper":
            self._plan_paper(ctx, signal, seg_len)
        else:
            self._plan_step(ctx, signal, seg_len, budget)
        ret = retention(normalised_importance(signal), self.lambda_solved_)
        ret[self.roles_ == ANCHOR] = 1.0
        self.retention_ = ret
        self._cap = budget

    def _fit_anchors(self, ctx: PolicyContext, n_anchor: int, seg_len: np.ndarray,
                     budget: int) -> tuple[int, int]:
        """(anchors, quota floor) whose λ = 0 prefill fits ``budget``: the configured ones,
        else fewer anchors, then no floor, then no anchors, with a warning naming the change
        (with few heads the paper's 5 anchors alone can exceed the budget)."""
        n_heads, m0, n_seg = ctx.heads.n_heads_total, self.min_per_segment, seg_len.size
        attempts = [(a, m0) for a in range(n_anchor, 0, -1)] + [(min(1, n_anchor), 0), (0, 0)]
        if n_anchor == 0:
            attempts = [(0, m0), (0, 0)]
        # the last attempt, (0, 0), keeps nothing at λ = 0 and always fits
        a, m = next((a, m) for a, m in attempts
                    if a * ctx.n_audio + (n_heads - a) * m * n_seg <= budget)
        if (a, m) != (n_anchor, m0):
            warnings.warn(
                f"wnw: at r={self.budget:g} the λ = 0 state of {n_anchor} anchors (all of T_a "
                f"each) and {m0} token(s) per segment exceeds the budget {budget}; running "
                f"with {a} anchors and {m} per segment",
                WnWBudgetWarning, stacklevel=5,
            )
        return a, m

    def _plan_paper(self, ctx: PolicyContext, signal: np.ndarray, seg_len: np.ndarray) -> None:
        n_voice, n_anchor = self.head_counts(ctx.heads.n_heads_total)
        a, m = self._fit_anchors(ctx, n_anchor, seg_len, ctx.budget_tokens(self.budget))
        self.roles_ = triage(signal, n_voice, a)
        self.min_per_segment_ = m
        self.solve_ = None
        if self.lam is not None:
            self.lambda_solved_, self.lam_source_ = float(self.lam), "given"
            return
        warnings.warn(
            f"wnw: no lam given at r={self.budget:g}; fitting λ on this input (per-input λ, "
            "not the paper's calibration-set λ; fit one with kvsim.policies.wnw_calibrate.fit_lambda "
            "and pass wnw:lam=...)",
            WnWBudgetWarning, stacklevel=4,
        )
        s_tilde = normalised_importance(signal)
        self.lambda_solved_ = fit_lambda_mean([(s_tilde, self.roles_, seg_len)], self.budget, m,
                                              self.name)
        self.lam_source_ = "input"

    def _plan_step(self, ctx: PolicyContext, signal: np.ndarray, seg_len: np.ndarray,
                   budget: int) -> None:
        n_voice, n_anchor = self.head_counts(ctx.heads.n_heads_total)
        s_tilde = normalised_importance(signal)
        reserve = 2 * self.top_k if self.reserve_segments is None else self.reserve_segments
        a, m = self._fit_anchors(ctx, n_anchor, seg_len, budget)
        self.roles_ = roles = triage(signal, n_voice, a)
        self.min_per_segment_ = m
        if self.lam is None:
            self.solve_ = solve_lambda(s_tilde, roles, seg_len, budget, reserve, m)
            self.lambda_solved_, self.lam_source_ = self.solve_.lam, "input"
            return
        self.solve_ = None
        self.lambda_solved_, self.lam_source_ = float(self.lam), "given"
        used = count_prefill_gpu(s_tilde, roles, seg_len, self.lambda_solved_, m)
        if used > budget:
            raise ValueError(
                f"wnw: lam={self.lam} keeps {used} audio tokens on GPU after prefill, over the "
                f"budget {budget} (r={self.budget}); lower lam, raise the budget or use "
                "budget_mode='paper'"
            )

    def _select_prefill(self, ctx: PolicyContext, view: PrefillView,
                        layout: SegmentLayout) -> np.ndarray:
        """§2.3 prefill compression: the GPU keep mask (L, H_kv, T_a) of every head."""
        L, H = ctx.heads.n_layers, ctx.heads.n_kv_heads
        quota = kept_per_segment(self.retention_.ravel(), layout.seg_len, self.min_per_segment_)
        quota = quota.reshape(L, H, -1)
        p = window_scores(ctx, view, None)  # p^prefill: sum over window queries and GQA group
        keep = np.zeros((L, H, ctx.n_audio), dtype=bool)
        if self.prefill_selection == "segment":
            for j, (a, b) in enumerate(layout.seg_bounds):
                keep[..., a:b] = topk_mask(p[..., a:b], quota[..., j])
        else:
            keep = topk_mask(p, quota.sum(axis=-1))
        keep[self.roles_ == ANCHOR] = True
        return keep

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        layout = SegmentLayout.from_seconds(
            ctx.n_audio, ctx.audio_tokens_per_s, self.chunk_seconds, self.stride_seconds
        )
        self._layout = layout
        self._plan(ctx, self._signal(ctx), layout.seg_len)
        roles = self.roles_
        keep = self._select_prefill(ctx, view, layout)
        tiers = np.where(keep, TIER_GPU, TIER_GONE)
        tiers[(roles == TIDAL)[..., None] & ~keep] = TIER_CPU
        self._prefill_keep = keep
        self._tiers = tiers
        self._tidal = roles == TIDAL
        self._anchor_by_layer = {
            int(layer): np.flatnonzero(roles[layer] == ANCHOR)
            for layer in range(ctx.heads.n_layers) if (roles[layer] == ANCHOR).any()
        }
        self._group = ctx.heads.group
        self._prefill_gpu = int(keep.sum())
        # Recall cost of each segment: positions of tidal heads outside the prefill subset.
        tidal_missing = (~keep) & self._tidal[..., None]
        self._seg_cost = np.bincount(
            layout.seg_of_pos, weights=tidal_missing.sum(axis=(0, 1)),
            minlength=layout.n_segments,
        ).astype(np.int64)
        self._resident = np.zeros(layout.n_segments, dtype=bool)
        self._streak = np.zeros(layout.n_segments, dtype=np.int64)
        self._chunk_segs = [list(layout.chunk_segments(c)) for c in range(layout.n_chunks)]
        self.last_scores_: np.ndarray | None = None
        self._set_capacity()
        return tiers.copy()

    def _set_capacity(self) -> None:
        """``"paper"``: the worst case of recalls on top of prefill; ``"step"``: B, with a
        warning when no recall can ever fit under it."""
        if self.budget_mode == "paper":
            # resident ⊆ segments selected in the last δ steps: ≤ δ · top_k · (segments/chunk)
            per_chunk = max(len(c) for c in self._chunk_segs)
            n_max = min(self._layout.n_segments, self.delta * self.top_k * per_chunk)
            worst = int(np.sort(self._seg_cost)[::-1][:n_max].sum())
            self._cap = self._prefill_gpu + worst
            self._warn_if_every_chunk_is_selected()
            return
        if self._prefill_gpu > self._cap:  # defensive: _plan_step guarantees it
            raise AssertionError("wnw: prefill exceeds the budget")
        costs = self._seg_cost[self._seg_cost > 0]
        if self._anchor_by_layer and costs.size and self._prefill_gpu + costs.min() > self._cap:
            warnings.warn(
                f"wnw(step): at r={self.budget:g} no segment's recall fits under the budget "
                f"{self._cap} (prefill keeps {self._prefill_gpu}); WnW will never recall. "
                "Use budget_mode='paper' for the paper's accounting",
                WnWBudgetWarning, stacklevel=3,
            )

    def _warn_if_every_chunk_is_selected(self) -> None:
        """§2.3 selects the top-k chunks each step; when the audio has no more than k chunks,
        every tidal segment is recalled at every step and r_GPU nears r_GPU+CPU (paper mode)."""
        n = self._layout.n_chunks
        if n <= self.top_k and self._tidal.any() and self._seg_cost.any():
            warnings.warn(
                f"wnw: all {n} chunks of this audio ({self.chunk_seconds:g} s, stride "
                f"{self.stride_seconds:g} s) are among the top_k={self.top_k} selected at every "
                "step: every tidal segment is recalled, so r_GPU will approach r_GPU+CPU whatever "
                f"the target r={self.budget:g} (WnW is meant for audio of many chunks)",
                WnWBudgetWarning, stacklevel=4,
            )

    # ------------------------------------------------------------------------------ decode
    def anchor_scores(self, view: StepView) -> np.ndarray:
        """Eq. (2): Σ over anchor (layer, q-head) pairs of this step's audio softmax, (T_a,).

        Computed fresh at every call (the accumulator is reset every step)."""
        acc = np.zeros(self._tiers.shape[-1], dtype=np.float64)
        g = self._group
        for layer, kv_heads in self._anchor_by_layer.items():
            att = view.audio_attention(layer)  # (H_q, T_a)
            q_heads = (kv_heads[:, None] * g + np.arange(g)[None, :]).ravel()
            acc += att[q_heads].sum(axis=0, dtype=np.float64)
        return acc

    def decode_step(self, view: StepView) -> np.ndarray | None:
        if not self._anchor_by_layer or not self._tidal.any():
            return None
        scores = self.anchor_scores(view)
        self.last_scores_ = scores
        chunk = self._layout.chunk_scores(scores)
        k = min(self.top_k, chunk.size)
        top = np.argsort(-chunk, kind="stable")[:k]
        selected: list[int] = []
        for c in top:
            for j in self._chunk_segs[int(c)]:
                if j not in selected:
                    selected.append(j)
        sel = np.zeros_like(self._resident)
        sel[selected] = True
        self._streak[sel] = 0
        self._streak[self._resident & ~sel] += 1
        lagging = np.flatnonzero(self._resident & ~sel & (self._streak < self.delta))
        lagging = lagging[np.lexsort((lagging, self._streak[lagging]))]
        new_res = np.zeros_like(self._resident)
        used = self._prefill_gpu
        for j in [*selected, *lagging.tolist()]:
            cost = int(self._seg_cost[j])
            if used + cost <= self._cap:
                new_res[j] = True
                used += cost
        self._streak[~new_res] = 0
        changed = new_res != self._resident
        self._resident = new_res
        if not self._seg_cost[changed].any():  # no tier moves (nothing or only free segments)
            return None
        pos_res = new_res[self._layout.seg_of_pos]  # (T_a,)
        tidal_gpu = self._prefill_keep | pos_res[None, None, :]
        tidal_tiers = np.where(tidal_gpu, TIER_GPU, TIER_CPU)
        self._tiers[self._tidal] = tidal_tiers[self._tidal]
        return self._tiers.copy()

    def step_attention_layers(self) -> list[int] | None:
        return sorted(self._anchor_by_layer)  # eq. (2) reads the anchor heads' layers only

    def gpu_capacity(self) -> int | None:
        return self._cap

    @property
    def resident_segments_(self) -> np.ndarray:
        """Segments currently recalled in full for every tidal head (bool, n_segments)."""
        return self._resident.copy()
