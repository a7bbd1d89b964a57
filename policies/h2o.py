"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023), restricted to the audio span.

H2O (Algorithm 1, "H2 eviction"; section "Heavy-Hitter Oracle") keeps a KV cache of ``k``
tokens made of *heavy hitters*, the tokens with the largest attention accumulated over every
query so far, plus the most *recent* tokens; the paper's default splits the budget evenly
(heavy ratio = recent ratio). When the cache is over budget it evicts, for good, the
non-recent token with the smallest accumulated score.

Reading under the audio-only scope (WnW §3.3; written down because the paper does not cover it):

* budget per (layer, KV-head) ``B = floor(r * T_a)``, every step;
* "recent" = the last ``floor(B * recent_fraction)`` positions of the *audio* span (the text
  prompt and generated tokens after it are always resident, so the recent audio is the end of
  the audio), the other ``B - floor(B * recent_fraction)`` slots go to heavy hitters;
* the accumulated score is seeded at prefill with the attention the observation-window queries
  (the prompt text after the audio; H2O uses every prompt query, we have those) put on each
  audio position, summed over the GQA group, and grows at every decode step by the attention
  the compressed model paid (``StepView.audio_attention``, zero on evicted positions);
* H2O evicts when a new token takes the cache over budget. The audio span does not grow
  during decoding (generated tokens are outside it and always resident) and the prefill
  selection holds ``B`` positions per head, so no audio position is evicted after prefill:
  ``decode_step`` accumulates the scores (``scores``) and leaves the tiers as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._params import require_int, require_real
from kvsim.policies._scoring import uniform_head_budget, window_scores
from kvsim.policies.base import (
    TIER_GONE,
    TIER_GPU,
    Policy,
    PolicyContext,
    PrefillView,
    StepView,
    all_audio_attention,
    topk_mask,
)
from kvsim.policies.registry import register


@register
@dataclass
class H2O(Policy):
    """Heavy hitters by accumulated attention + a recent audio window, budget every step.

    Parameters
    ----------
    recent_fraction : float
        Share of the per-head budget given to the recent window (H2O's experiments split the
        cache evenly between heavy hitters and recent tokens: heavy ratio = recent ratio).
    window : int
        Observation queries that seed the accumulated scores at prefill (0 = all of them, as
        H2O accumulates over every query; a positive value uses the last ``window``).
    """

    name = "h2o"
    paper = (
        "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, "
        "NeurIPS 2023"
    )
    needs_step_attention = True

    recent_fraction: float = 0.5
    window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_real(n, "recent_fraction", self.recent_fraction, lo=0, hi=1)
        require_int(n, "window", self.window, lo=0)  # 0 = every observation query (H2O)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self._group = ctx.heads.group
        self._head_budget = uniform_head_budget(ctx, self.budget)
        n_recent = int(np.floor(self._head_budget * self.recent_fraction + 1e-9))
        self._recent = np.zeros(ctx.n_audio, dtype=bool)
        if n_recent:
            self._recent[ctx.n_audio - n_recent :] = True
        #: accumulated attention per (layer, KV-head, audio position)
        self.scores = window_scores(ctx, view, self.window or None).copy()  # grows every step
        heavy = topk_mask(
            np.where(self._recent, -np.inf, self.scores), self._head_budget - n_recent
        )
        self._capacity = self._head_budget * ctx.heads.n_heads_total
        return np.where(heavy | self._recent, TIER_GPU, TIER_GONE)

    def decode_step(self, view: StepView) -> np.ndarray | None:
        n_layers, n_kv, n_audio = self.scores.shape
        att = all_audio_attention(view, n_layers)  # (L, H_q, T_a)
        # every layer at once: the float64 GQA-group sum of kv_group_sum, layer by layer
        self.scores += att.reshape(n_layers, n_kv, self._group, n_audio).sum(
            axis=2, dtype=np.float64)
        return None

    def gpu_capacity(self) -> int | None:
        return self._capacity
