"""VoxZip stage 2 (temporal-decay KV eviction) on the audio span, in VoxZip's generation scope
or WnW §3.3's audio-only scope.

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
  audio tokens, recent window = the last ``floor(recent_fraction · b)`` tokens, top-N fills
  the rest;
* the score is seeded with the prefill observation window: the recurrence runs over the
  window queries in prompt order (``A ← γ·A + Σ_group softmax_w``), then selects;
* during decoding the recurrence continues with the compressed model's attention and the
  rule is re-applied to the resident set; evicted tokens are GONE (no recall).

Scope (``scope``). VoxZip evicts "during the generation stage": every decode step appends the
generated token to the cache ("zero-padding concatenation to align the dimension for the newly
generated token") and the rule then keeps T sinks, the latest M tokens and the top-N, which
"bound[s] the inference context". Its budget therefore covers the generated tokens too.

* ``"generation"`` (default, VoxZip's scope): the per-head budget ``b`` covers the audio *and*
  the generated tokens. kvsim keeps generated tokens on GPU (the policy protocol manages the
  audio span only), so they win the top-N contest: after decode step ``s`` (``g = s + 1``
  generated tokens in the cache) the recent window is the last ``M`` positions of
  audio ++ generated (its audio part shrinks to ``max(M − g, 0)`` tokens) and the audio keeps
  ``max(b − g, min(T, b))`` tokens: one audio token per (layer, KV-head) is evicted at every
  step, the lowest-scoring resident one outside the sinks and the recent window, until only
  the sinks are left (the cache then exceeds ``b`` by the generated tokens, which kvsim never
  evicts). r_GPU is still WnW §3.4's audio ratio and falls by ``1/T_a`` per step;
  :func:`cache_retention` gives VoxZip's own ratio, (audio + generated) / (L·H_kv·T_a), which
  stays at the prefill value while ``g ≤ b − min(T, b)``.
* ``"audio"`` (WnW §3.3's audio-only scope): generated tokens are kept outside the budget, the
  audio does not grow, the cache is at ``b`` after prefill and the decode rule (top-N *of the
  resident tokens*, exactly ``b``) never evicts: the policy is static after prefill and
  does not request step attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._params import require_choice, require_int, require_real
from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import (
    TIER_GONE,
    TIER_GPU,
    Policy,
    PolicyContext,
    PrefillView,
    StepView,
    all_audio_attention,
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


def recent_count(budget: int, n_sink: int, recent_fraction: float) -> int:
    """M: ``floor(recent_fraction · budget)`` capped by what the sinks leave of the budget."""
    return min(int(np.floor(recent_fraction * budget + 1e-9)), budget - min(n_sink, budget))


def partition_keep(scores: np.ndarray, n_sink: int, n_recent: int, n_total: int,
                   allowed: np.ndarray | None = None) -> np.ndarray:
    """The first ``n_sink`` and last ``n_recent`` positions of every row, plus the top-scoring
    ``allowed`` others up to ``n_total`` per row (bool mask, same shape as ``scores``)."""
    n = scores.shape[-1]
    fixed = np.zeros(n, dtype=bool)
    fixed[:n_sink] = True
    if n_recent > 0:
        fixed[n - n_recent:] = True
    allowed = np.ones(scores.shape, dtype=bool) if allowed is None else allowed
    keep = np.broadcast_to(fixed, scores.shape) & allowed
    left = n_total - keep.sum(axis=-1)
    candidates = allowed & ~keep
    surplus = candidates.sum(axis=-1) - left
    if surplus.max(initial=0) <= 1 and np.isfinite(scores).all():
        return _drop_lowest(scores, candidates, surplus > 0) | keep
    cand = np.where(keep | ~allowed, -np.inf, scores)
    extra = topk_mask(cand, left) & ~keep & allowed
    return keep | extra


def _drop_lowest(scores: np.ndarray, candidates: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``candidates`` less, in every row where ``rows`` is set, its lowest-scoring candidate
    (among equal lowest scores the latest position: the one :func:`topk_mask`, which breaks
    ties towards the earlier position, leaves out).

    What :func:`partition_keep` keeps when at most one candidate per row is over the count,
    as at every decode step of the generation scope, without sorting the rows; the same mask
    bit for bit (``tests/test_policy_voxzip.py``).
    """
    out = candidates.copy()
    if not rows.any():
        return out
    masked = np.where(candidates, scores, np.inf)
    low = masked.min(axis=-1, keepdims=True)
    n = scores.shape[-1]
    last = n - 1 - np.argmax((masked == low)[..., ::-1], axis=-1)
    idx = np.nonzero(rows)
    out[(*idx, last[idx])] = False
    return out


def sink_recent_topn(
    scores: np.ndarray, budget: int, n_sink: int, recent_fraction: float, allowed: np.ndarray | None = None
) -> np.ndarray:
    """VoxZip's partition: sinks ∪ recent window ∪ top-N by score, per row of ``scores``.

    ``allowed`` (same shape, bool) restricts every choice to resident positions. Returns a bool
    mask with at most ``budget`` entries per row.
    """
    budget = min(budget, scores.shape[-1])
    sink = min(n_sink, budget)
    return partition_keep(scores, sink, recent_count(budget, n_sink, recent_fraction), budget,
                          allowed)


def generation_scope_keep(scores: np.ndarray, allowed: np.ndarray, budget: int, n_generated: int,
                          n_sink: int, recent_fraction: float) -> np.ndarray:
    """VoxZip's rule when the budget also covers ``n_generated`` kept generated tokens.

    The recent window is the last ``M`` positions of audio ++ generated, so its audio part is
    the last ``max(M − g, 0)`` audio tokens; the generated tokens older than the window take
    their share of the top-N; the audio keeps ``max(b − g, min(T, b))`` tokens per row.
    """
    budget = min(budget, scores.shape[-1])
    sink = min(n_sink, budget)
    recent = recent_count(budget, n_sink, recent_fraction)
    n_audio = max(budget - n_generated, sink)
    return partition_keep(scores, sink, max(recent - n_generated, 0), n_audio, allowed)


def cache_retention(gpu_audio_tokens: np.ndarray, n_generated: np.ndarray, n_heads_total: int,
                    n_audio: int) -> np.ndarray:
    """VoxZip's cache ratio per step: (GPU audio KV + generated KV of every (layer, KV-head))
    over WnW §3.4's N_full^audio = L·H_kv·T_a (``scope="generation"`` keeps it at the target).

    ``gpu_audio_tokens`` is the step log's column; ``n_generated`` the generated tokens in the
    cache after each step (``step + 1``).
    """
    total = n_heads_total * n_audio
    return (np.asarray(gpu_audio_tokens) + n_heads_total * np.asarray(n_generated)) / total


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
    scope : str
        ``"generation"`` (VoxZip's: the budget covers the generated tokens, one audio token per
        head is evicted at every decode step) or ``"audio"`` (WnW §3.3's audio-only scope:
        static after prefill). See the module docstring.
    """

    name = "voxzip"
    paper = "VoxZip: Semantic-Anchored Temporal KV Cache Compression (stage 2, temporal decay)"

    gamma: float = 0.95
    n_sink: int = 4
    recent_fraction: float = 0.2
    scoring: str = "head"
    scope: str = "generation"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_real(n, "gamma", self.gamma, lo=0, hi=1, lo_open=True)
        require_int(n, "n_sink", self.n_sink, lo=0)
        require_real(n, "recent_fraction", self.recent_fraction, lo=0, hi=1)
        require_choice(n, "scoring", self.scoring, ("head", "layer"))
        require_choice(n, "scope", self.scope, ("generation", "audio"))
        # only the generation scope evicts while decoding, so only it reads step attention
        self.needs_step_attention = self.scope == "generation"

    def _head_attention(self, att: np.ndarray) -> np.ndarray:
        """(H_q, T) attention rows -> what the recurrence adds per KV-head, (H_kv, T)."""
        per_kv = kv_group_sum(att, self._group)
        if self.scoring == "layer":  # one vector per layer, shared by its KV-heads
            return np.broadcast_to(per_kv.sum(axis=0), per_kv.shape)
        return per_kv

    def _window_recurrence(self, score: np.ndarray, att: np.ndarray) -> np.ndarray:
        """One layer's (H_kv, T_a) score after the recurrence over its (H_q, W, T_a) window
        attention, query by query."""
        for w in range(att.shape[1]):
            score = decayed_accumulate(score, self._head_attention(att[:, w, :]), self.gamma)
        return score

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self._group = ctx.heads.group
        L, H, T = ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio

        def accumulate() -> np.ndarray:
            score = np.zeros((L, H, T), dtype=np.float64)
            for layer in range(L):  # no reference to a layer's attention outlives its line
                score[layer] = self._window_recurrence(score[layer], view.audio_attention(layer))
            return score

        # independent of the budget: computed once per prefill view for every VoxZip run
        score = shared(view, ("voxzip-prefill", self.gamma, self.scoring), accumulate).copy()
        self.scores_ = score
        self._budget = uniform_head_budget(ctx, self.budget)
        keep = sink_recent_topn(score, self._budget, self.n_sink, self.recent_fraction)
        self._keep = keep
        self._capacity = self._budget * ctx.heads.n_heads_total
        return np.where(keep, TIER_GPU, TIER_GONE)

    def update_scores(self, step_attention: list[np.ndarray] | np.ndarray, *,
                      n_generated: int) -> np.ndarray:
        """Apply one decode step of the recurrence (per layer (H_q, T_a) attention) and the
        eviction rule of the scope on the resident set (``n_generated``: generated tokens now
        in the cache); returns the (possibly unchanged) keep mask."""
        att = np.asarray(step_attention)  # (L, H_q, T_a)
        n_layers, h_q, n_audio = att.shape
        if n_audio != self.scores_.shape[-1]:
            raise ValueError(f"attention has {n_audio} positions, the score {self.scores_.shape[-1]}")
        # the recurrence of every layer at once: the same float32 group sums and float64
        # γ·A + a, element for element, as decayed_accumulate layer by layer
        per_kv = att.reshape(n_layers, h_q // self._group, self._group, n_audio).sum(axis=2)
        if self.scoring == "layer":
            per_kv = np.broadcast_to(per_kv.sum(axis=1, keepdims=True), per_kv.shape)
        np.multiply(self.scores_, self.gamma, out=self.scores_)
        self.scores_ += per_kv
        if self.scope == "generation":
            self._keep = generation_scope_keep(self.scores_, self._keep, self._budget,
                                               n_generated, self.n_sink, self.recent_fraction)
        else:
            self._keep = sink_recent_topn(self.scores_, self._budget, self.n_sink,
                                          self.recent_fraction, allowed=self._keep)
        return self._keep

    def decode_step(self, view: StepView) -> np.ndarray | None:
        """Generation scope: after step ``s`` the cache holds ``s + 1`` generated tokens; the
        recurrence takes this step's compressed attention and the rule evicts (module
        docstring). Audio scope: nothing ever changes after prefill."""
        if self.scope == "audio":
            return None
        att = all_audio_attention(view, self.scores_.shape[0])
        keep = self.update_scores(att, n_generated=view.step + 1)
        return np.where(keep, TIER_GPU, TIER_GONE)

    def gpu_capacity(self) -> int | None:
        """The prefill budget over every head: an upper bound at every step (the generation
        scope only shrinks the resident set, to ``max(b - n_generated, min(n_sink, b))`` per
        head after ``n_generated`` tokens, which ``tests/test_policy_voxzip.py`` checks)."""
        return self._capacity
