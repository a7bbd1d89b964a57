"""StreamingLLM (Xiao et al., 2024): attention sinks + a recent window, within the audio span.

Under the audio-only scope (WnW §3.3) the recent window is the *end of the audio*: generated
tokens are always kept, so "recent" audio means the last audio tokens before the prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kvsim.policies._params import require_int
from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import Policy, PolicyContext, PrefillView, Tier, full_tiers
from kvsim.policies.registry import register


@register
@dataclass
class StreamingLLM(Policy):
    """Keep the first ``n_sink`` audio tokens and the most recent ``floor(r*T_a) - n_sink``.

    Parameters
    ----------
    n_sink : int
        Attention-sink tokens at the start of the audio (StreamingLLM keeps 4 initial tokens as
        attention sinks, its default).
    """

    name = "streaming"
    paper = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024"

    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "n_sink", self.n_sink, lo=0)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        budget = uniform_head_budget(ctx, self.budget)
        tiers = full_tiers(ctx, Tier.GONE)
        sink = min(self.n_sink, budget)
        tiers[..., :sink] = Tier.GPU
        recent = budget - sink
        if recent > 0:
            tiers[..., ctx.n_audio - recent :] = Tier.GPU
        self._capacity = budget * ctx.heads.n_heads_total
        return tiers

    def gpu_capacity(self) -> int | None:
        return self._capacity
