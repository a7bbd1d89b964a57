"""StreamingLLM (Xiao et al., 2024): attention sinks + a recent window, within the audio span.

Under the audio-only scope (WnW §3.3) the recent window is the *end of the audio*: generated
tokens are always kept, so "recent" audio means the last audio tokens before the prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._params import require_int
from kvsim.policies.base import PolicyContext, PrefillView, descending_ranks, shared
from kvsim.policies.registry import register
from kvsim.policies.scoring import ScoringPolicy


@register
@dataclass
class StreamingLLM(ScoringPolicy):
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

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Sinks first (earliest best), then recency: a top-``B`` keeps the first
        ``min(n_sink, B)`` positions and the last ``B - min(n_sink, B)``."""
        t_a = ctx.n_audio
        pos = np.arange(t_a, dtype=np.float64)
        per_pos = np.where(pos < self.n_sink, 2.0 * t_a - pos, pos)  # sinks > any recency
        return np.broadcast_to(per_pos, (ctx.heads.n_layers, ctx.heads.n_kv_heads, t_a))

    def ranks(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        # the same order at every budget: ranked once per prefill view
        shape = (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio)
        return shared(view, ("streaming", self.n_sink, shape),
                      lambda: descending_ranks(self.score(ctx, view)))
