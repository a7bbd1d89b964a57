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
    at least one per segment, see below) or the same total as one global top-k
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

Budget (our precise reading of §3.4; the paper solves λ on a calibration set so that the
*mean* measured r_GPU matches the target, and reports e.g. 22.25% at a 0.2 target):
    ``B = floor(r · L · H_kv · T_a)`` is a hard cap at **every** step (``gpu_capacity() == B``).
    λ is solved by bisection so that ``prefill_gpu(λ) + reserve(λ) <= B``, where
    ``prefill_gpu`` counts GPU audio tokens right after prefill including the anchors' full
    T_a, and ``reserve`` is the recall headroom of the ``reserve_segments`` most expensive
    segments (default ``2·top_k``: one step's worth of selected chunks). During decoding the
    GPU count therefore oscillates between ``prefill_gpu`` and ``B`` as segments are recalled
    and released (the paper's Fig. 4 "slight oscillation"). If a step's recalls would exceed
    B, recalls are granted in chunk-rank order and lagging (unselected, not yet released)
    segments are released early to make room; a selected segment that still does not fit is
    not recalled that step. An explicit ``lambda_`` skips the solve; it must fit B.

Small models: anchors are clipped to what fits the budget (at least one per segment for the
other heads when possible); if even that does not fit, the one-per-segment floor is dropped
and then anchors go to zero (no observer: recall is disabled). The effective values are in
``roles_``, ``lambda_solved_`` and ``min_per_segment_``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from kvsim.policies._scoring import window_scores
from kvsim.policies._wnw_layout import (
    ANCHOR,
    TIDAL,
    SegmentLayout,
    SolveResult,
    count_prefill_gpu,
    default_voice_fraction,
    kept_per_segment,
    normalised_importance,
    retention,
    solve_lambda,
    triage,
)
from kvsim.policies.base import (
    TIER_DTYPE,
    Policy,
    PolicyContext,
    PrefillView,
    StepView,
    Tier,
    topk_mask,
)
from kvsim.policies.registry import register

_SIGNALS = ("vs_hs", "vs", "hs")
_SELECTIONS = ("segment", "global")
_MODES = ("step", "prefill")


@register
@dataclass
class WnW(Policy):
    """Waxing-and-Waning KV cache: anchor / tidal / fixed heads with decode-time chunk swap.

    Parameters
    ----------
    n_voice : int or None
        Voice heads (anchors + tidal). None: ``round(f(r) · L · H_kv)`` with ``f`` the
        paper's fraction {0.375, 0.208, 0.125, 0.125} at r = {0.2, 0.4, 0.6, 0.8} (§3.4),
        linearly interpolated, constant outside.
    n_anchor : int
        Anchor heads (paper: 5), taken from the top of the voice heads.
    lambda_ : float or None
        Explicit eq. (1) scale λ; None solves λ for the budget (see module docstring).
    chunk_seconds, stride_seconds : float
        W_c = 4 s and W_s = 2 s (§2.3); token counts use ``ceil(W · r_tok)``.
    top_k : int
        Chunks selected per decode step (paper: 3).
    delta : int
        Consecutive unselected steps before a recalled segment is released (paper: 3).
    prefill_selection : str
        ``"segment"`` (WnW) or ``"global"`` top-k with the same total (ablation A2).
    triage_signal : str
        ``"vs_hs"`` (WnW), ``"vs"`` or ``"hs"`` (ablation A3): ranks heads for both triage
        steps and is the importance s̃ normalises in eq. (1).
    reserve_segments : int or None
        Segments of recall headroom kept free in the λ solve; None = ``2 · top_k``.
    budget_mode : str
        ``"step"`` (default): ``floor(r·L·H_kv·T_a)`` is a hard cap at every step (see the
        module docstring). ``"prefill"``: the paper's accounting -- λ is solved so that the
        GPU audio tokens *after prefill* meet the budget, recalls come on top, and
        ``gpu_capacity()`` is the true worst case, prefill + the recall cost of the
        ``delta · top_k · (segments per chunk)`` most expensive segments; the measured mean
        r_GPU then sits above the target, as in the paper's Table 5 (22.25% at 0.2).
    """

    name = "wnw"
    paper = "WnW: Waxing-and-Waning KV Cache for Long-Form Speech LLMs (§2.2-2.3, §3.4, §3.8)"
    recallable = True
    needs_step_attention = True

    n_voice: int | None = None
    n_anchor: int = 5
    lambda_: float | None = None
    chunk_seconds: float = 4.0
    stride_seconds: float = 2.0
    top_k: int = 3
    delta: int = 3
    prefill_selection: str = "segment"
    triage_signal: str = "vs_hs"
    reserve_segments: int | None = None
    budget_mode: str = "step"

    roles_: np.ndarray | None = field(default=None, init=False, repr=False)
    retention_: np.ndarray | None = field(default=None, init=False, repr=False)
    lambda_solved_: float | None = field(default=None, init=False, repr=False)
    min_per_segment_: int = field(default=1, init=False, repr=False)
    solve_: SolveResult | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        ints = ("n_anchor", "top_k", "delta") + tuple(
            k for k in ("n_voice", "reserve_segments") if getattr(self, k) is not None
        )
        for k in ints:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"wnw: {k} must be an integer, got {v!r}")
        nums = ("chunk_seconds", "stride_seconds") + (("lambda_",) if self.lambda_ is not None else ())
        for k in nums:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
                raise ValueError(f"wnw: {k} must be a number, got {v!r}")
        if not (0 < self.stride_seconds <= self.chunk_seconds):
            raise ValueError(
                f"wnw: need 0 < stride_seconds <= chunk_seconds, got {self.stride_seconds}, "
                f"{self.chunk_seconds}"
            )
        if self.budget_mode not in _MODES:
            raise ValueError(f"wnw: budget_mode must be one of {_MODES}, got {self.budget_mode!r}")
        if self.triage_signal not in _SIGNALS:
            raise ValueError(f"wnw: triage_signal must be one of {_SIGNALS}, got {self.triage_signal!r}")
        if self.prefill_selection not in _SELECTIONS:
            raise ValueError(
                f"wnw: prefill_selection must be one of {_SELECTIONS}, got {self.prefill_selection!r}"
            )
        if self.n_voice is not None and self.n_voice < 0:
            raise ValueError(f"wnw: n_voice must be >= 0, got {self.n_voice}")
        if self.n_anchor < 0 or self.top_k < 1 or self.delta < 1:
            raise ValueError("wnw: need n_anchor >= 0, top_k >= 1, delta >= 1")
        if self.lambda_ is not None and self.lambda_ < 0:
            raise ValueError(f"wnw: lambda_ must be >= 0, got {self.lambda_}")
        if self.reserve_segments is not None and self.reserve_segments < 0:
            raise ValueError(f"wnw: reserve_segments must be >= 0, got {self.reserve_segments}")

    # ------------------------------------------------------------------------------ prefill
    def _signal(self, ctx: PolicyContext) -> np.ndarray:
        hs = ctx.require_head_scores(self.name)
        return {
            "vs_hs": hs.importance,
            "vs": hs.voice_score,
            "hs": hs.sensitivity,
        }[self.triage_signal]

    def _plan(self, ctx: PolicyContext, signal: np.ndarray, seg_len: np.ndarray) -> None:
        """Fix roles, min-per-segment floor and λ so that the budget is feasible."""
        n_heads = ctx.heads.n_heads_total
        budget = ctx.budget_tokens(self.budget)
        n_voice = (
            int(round(default_voice_fraction(self.budget) * n_heads))
            if self.n_voice is None
            else self.n_voice
        )
        n_voice = min(max(n_voice, 0), n_heads)
        n_anchor = min(self.n_anchor, n_voice)
        s_tilde = normalised_importance(signal)
        reserve = 2 * self.top_k if self.reserve_segments is None else self.reserve_segments
        if self.budget_mode == "prefill":
            reserve = 0
        n_seg = seg_len.size
        # Feasibility at λ = 0 (anchors keep T_a each, others min_per_segment per segment).
        attempts = [(a, 1) for a in range(n_anchor, 0, -1)] + [(1, 0), (0, 0)]
        if n_anchor == 0:
            attempts = [(0, 1), (0, 0)]
        chosen = attempts[-1]
        for a, m in attempts:
            a = min(a, n_anchor)
            if a * ctx.n_audio + (n_heads - a) * m * n_seg <= budget:
                chosen = (a, m)
                break
        a, m = chosen
        roles = triage(signal, n_voice, a)
        self.roles_ = roles
        self.min_per_segment_ = m
        if self.lambda_ is None:
            res = solve_lambda(s_tilde, roles, seg_len, budget, reserve, m)
            self.solve_ = res
            lam = res.lam
        else:
            self.solve_ = None
            lam = float(self.lambda_)
            used = count_prefill_gpu(s_tilde, roles, seg_len, lam, m)
            if used > budget:
                raise ValueError(
                    f"wnw: lambda_={lam} keeps {used} audio tokens on GPU after prefill, over the "
                    f"budget {budget} (r={self.budget}); lower lambda_ or raise the budget"
                )
        self.lambda_solved_ = lam
        ret = retention(s_tilde, lam)
        ret[roles == ANCHOR] = 1.0
        self.retention_ = ret
        self._cap = budget

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        signal = self._signal(ctx)
        layout = SegmentLayout.from_seconds(
            ctx.n_audio, ctx.audio_tokens_per_s, self.chunk_seconds, self.stride_seconds
        )
        seg_len = layout.seg_len
        self._layout = layout
        self._plan(ctx, signal, seg_len)
        roles = self.roles_
        L, H, T = ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio
        quota = kept_per_segment(self.retention_.ravel(), seg_len, self.min_per_segment_)
        quota = quota.reshape(L, H, -1)
        p = window_scores(ctx, view, None)  # p^prefill: sum over window queries and GQA group
        keep = np.zeros((L, H, T), dtype=bool)
        if self.prefill_selection == "segment":
            for j, (a, b) in enumerate(layout.seg_bounds):
                keep[..., a:b] = topk_mask(p[..., a:b], quota[..., j])
        else:
            keep = topk_mask(p, quota.sum(axis=-1))
        keep[roles == ANCHOR] = True
        tiers = np.where(keep, Tier.GPU, Tier.GONE).astype(TIER_DTYPE)
        tiers[(roles == TIDAL)[..., None] & ~keep] = Tier.CPU
        self._prefill_keep = keep
        self._tiers = tiers
        self._tidal = roles == TIDAL
        self._anchor_by_layer = {
            int(layer): np.flatnonzero(roles[layer] == ANCHOR) for layer in range(L)
        }
        self._anchor_by_layer = {k: v for k, v in self._anchor_by_layer.items() if v.size}
        self._group = ctx.heads.group
        self._prefill_gpu = int(keep.sum())
        # Recall cost of each segment: positions of tidal heads outside the prefill subset.
        tidal_missing = (~keep) & self._tidal[..., None]
        seg_of_pos = layout.seg_of_pos
        self._seg_cost = np.bincount(
            seg_of_pos, weights=tidal_missing.sum(axis=(0, 1)), minlength=layout.n_segments
        ).astype(np.int64)
        self._resident = np.zeros(layout.n_segments, dtype=bool)
        self._streak = np.zeros(layout.n_segments, dtype=np.int64)
        self._chunk_segs = [list(layout.chunk_segments(c)) for c in range(layout.n_chunks)]
        self.last_scores_: np.ndarray | None = None
        if self._prefill_gpu > self._cap:  # defensive: _plan guarantees it
            raise AssertionError("wnw: prefill exceeds the budget")
        if self.budget_mode == "prefill":
            # resident ⊆ segments selected in the last δ steps: ≤ δ · top_k · (segments/chunk)
            per_chunk = max(len(c) for c in self._chunk_segs)
            n_max = min(layout.n_segments, self.delta * self.top_k * per_chunk)
            worst = int(np.sort(self._seg_cost)[::-1][:n_max].sum())
            self._cap = self._prefill_gpu + worst
        return tiers.copy()

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
        tidal_tiers = np.where(tidal_gpu, Tier.GPU, Tier.CPU).astype(TIER_DTYPE)
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
