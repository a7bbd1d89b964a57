"""VoxZip stage 2 (temporal-decay KV eviction) on the audio span, audio-only scope (WnW §3.3).

VoxZip §"dynamic KV cache eviction": per layer, the time-decayed accumulated score is
``A^(t) = γ · [A^(t-1), 0] + softmax(q_t K_t^T / √d)`` (γ = 0.95); the cache keeps the first
``T = 4`` attention-sink tokens, a recent window holding 20% of the budget, and the top-N
remaining tokens by ``A``. Our adaptation:

* scoring (``scoring``): VoxZip keeps one score vector *per layer* ("operating independently
  per layer, the time-decayed accumulated score vector A^(t) ∈ R^{1×t}"), which ``"layer"``
  reproduces: the softmax rows of every q-head of the layer are summed and all KV-heads of
  the layer keep the same positions. kvsim's default ``"head"`` scores per (layer, KV-head):
  the rows of the g q-heads of a GQA group are summed (the group shares one KV set, as in
  SnapKV's voting), so each KV-head keeps what its own queries attend to — the granularity
  of every other score-based policy here (SnapKV, Ada-KV, PyramidKV, AudioKV), which keeps
  the comparison about scores rather than granularity;
* budget per (layer, KV-head): ``b = floor(r · T_a)``; sinks = the first ``min(T, b)``
  audio tokens, recent window = the last ``floor(recent_fraction · b)`` audio tokens (the end
  of the audio, as in ``streaming``: generated tokens are kept anyway), top-N fills the rest;
* the score is seeded with the prefill observation window: the recurrence runs over the
  window queries in prompt order (``A ← γ·A + Σ_group softmax_w``), then selects;
* during decoding the recurrence continues with the compressed model's attention and the
  rule is re-applied to the resident set; evicted tokens are GONE (no recall).

Under the audio-only scope the audio span does not grow while decoding, so the cache is
already at ``b`` per head after prefill and the decode-time rule (top-N *of the resident
tokens*, which are exactly ``b``) never evicts more: VoxZip's decode-time eviction only acts
on the growing generated-token part, which the audio-only scope keeps in full. We therefore
do not request step attention (``needs_step_attention = False``); ``update_scores`` applies
the recurrence for callers that want the decayed scores (tests, studies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._params import require_choice, require_int, require_real
from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import (
    Policy,
    PolicyContext,
    PrefillView,
    Tier,
    kv_group_sum,
    shared,
    topk_mask,
)
from kvsim.policies.registry import register


def decayed_accumulate(prev: np.ndarray, attention: np.ndarray, gamma: float) -> np.ndarray:
    """One step of VoxZip's recurrence ``A ← γ · [A, 0] + a``.

    ``prev`` has shape (..., n) and ``attention`` (..., m) with m >= n: new positions (the
    ``[·, 0]`` padding) start at zero before the current attention is added.
    """
    prev = np.asarray(prev, dtype=np.float64)
    att = np.asarray(attention, dtype=np.float64)
    pad = att.shape[-1] - prev.shape[-1]
    if pad < 0:
        raise ValueError(f"attention has {att.shape[-1]} positions, fewer than the score {prev.shape[-1]}")
    padded = np.concatenate([prev, np.zeros((*prev.shape[:-1], pad))], axis=-1)
    return gamma * padded + att


def sink_recent_topn(
    scores: np.ndarray, budget: int, n_sink: int, recent_fraction: float, allowed: np.ndarray | None = None
) -> np.ndarray:
    """VoxZip's partition: sinks ∪ recent window ∪ top-N by score, per row of ``scores``.

    ``allowed`` (same shape, bool) restricts every choice to resident positions. Returns a bool
    mask with at most ``budget`` entries per row.
    """
    n = scores.shape[-1]
    budget = min(budget, n)
    sink = min(n_sink, budget)
    recent = min(int(np.floor(recent_fraction * budget + 1e-9)), budget - sink)
    fixed = np.zeros(n, dtype=bool)
    fixed[:sink] = True
    if recent > 0:
        fixed[n - recent :] = True
    allowed = np.ones(scores.shape, dtype=bool) if allowed is None else allowed
    keep = np.broadcast_to(fixed, scores.shape) & allowed
    left = budget - keep.sum(axis=-1)
    cand = np.where(keep | ~allowed, -np.inf, scores)
    extra = topk_mask(cand, left) & ~keep & allowed
    return keep | extra


@register
@dataclass
class VoxZip(Policy):
    """Temporal-decay accumulated attention + sinks + recent window (VoxZip stage 2).

    Parameters
    ----------
    gamma : float
        Decay factor γ (VoxZip, experimental setup: "empirically set to 0.95", the best of
        its Table 5 sweep; γ = 1 is plain H2O-style accumulation).
    n_sink : int
        Attention-sink tokens T always kept (VoxZip stage 2: "we empirically set T=4").
    recent_fraction : float
        Fraction of the budget given to the recent window M (VoxZip stage 2: "20% of the total
        KV cache budget").
    scoring : str
        ``"head"`` (kvsim's default: per KV-head, GQA group summed) or ``"layer"`` (VoxZip's
        one score vector per layer, shared by the layer's KV-heads).
    """

    name = "voxzip"
    paper = "VoxZip: Semantic-Anchored Temporal KV Cache Compression (stage 2, temporal decay)"

    gamma: float = 0.95
    n_sink: int = 4
    recent_fraction: float = 0.2
    scoring: str = "head"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_real(n, "gamma", self.gamma, lo=0, hi=1, lo_open=True)
        require_int(n, "n_sink", self.n_sink, lo=0)
        require_real(n, "recent_fraction", self.recent_fraction, lo=0, hi=1)
        require_choice(n, "scoring", self.scoring, ("head", "layer"))

    def _head_attention(self, att: np.ndarray) -> np.ndarray:
        """(H_q, T) attention rows -> what the recurrence adds per KV-head, (H_kv, T)."""
        per_kv = kv_group_sum(att, self._group)
        if self.scoring == "layer":  # one vector per layer, shared by its KV-heads
            return np.broadcast_to(per_kv.sum(axis=0), per_kv.shape)
        return per_kv

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self._group = ctx.heads.group
        L, H, T = ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio

        def accumulate() -> np.ndarray:
            score = np.zeros((L, H, T), dtype=np.float64)
            for layer in range(L):
                att = view.audio_attention(layer)  # (H_q, W, T_a)
                for w in range(att.shape[1]):
                    score[layer] = decayed_accumulate(
                        score[layer], self._head_attention(att[:, w, :]), self.gamma)
            return score

        # independent of the budget: computed once per prefill view for every VoxZip run
        score = shared(view, ("voxzip-prefill", self.gamma, self.scoring), accumulate).copy()
        self.scores_ = score
        self._budget = uniform_head_budget(ctx, self.budget)
        keep = sink_recent_topn(score, self._budget, self.n_sink, self.recent_fraction)
        self._keep = keep
        self._capacity = self._budget * ctx.heads.n_heads_total
        return np.where(keep, Tier.GPU, Tier.GONE).astype(np.uint8)

    def update_scores(self, step_attention: list[np.ndarray]) -> np.ndarray:
        """Apply one decode step of the recurrence (per layer (H_q, T_a) attention) and the
        eviction rule on the resident set; returns the (possibly unchanged) keep mask."""
        for layer, att in enumerate(step_attention):
            self.scores_[layer] = decayed_accumulate(
                self.scores_[layer], self._head_attention(np.asarray(att)), self.gamma
            )
        self._keep = sink_recent_topn(
            self.scores_, self._budget, self.n_sink, self.recent_fraction, allowed=self._keep
        )
        return self._keep

    def gpu_capacity(self) -> int | None:
        return self._capacity
