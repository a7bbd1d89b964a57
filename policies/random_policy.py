"""Random eviction: a control that keeps ``floor(r * T_a)`` uniformly random audio positions.

Not from a paper: it is the floor every scoring policy must beat (WnW §2.1 compares top-K
overlaps against the random baseline ``K / T_a``). The draw is seeded by ``ctx.seed`` so a run
is reproducible; each (layer, KV-head) gets an independent uniform subset of exact size.
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
class RandomPolicy(ScoringPolicy):
    """Keep a uniformly random ``floor(r * T_a)``-subset per (layer, KV-head) at prefill.

    Parameters
    ----------
    salt : int
        Mixed with ``ctx.seed`` to draw independent subsets at the same seed; >= 0 (0; a
        control, no paper value).
    """

    name = "random"
    paper = "Control: uniformly random audio KV eviction (WnW §2.1 random baseline)"

    salt: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "salt", self.salt, lo=0)

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Independent uniform [0, 1) draws, seeded by ``ctx.seed`` and ``salt``."""
        shape = (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio)
        return np.random.default_rng([int(ctx.seed), int(self.salt), 0x6B7673]).random(shape)

    def ranks(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        # the same draw at every budget (nested subsets): ranked once per prefill view
        shape = (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio)
        return shared(view, ("random", ctx.seed, self.salt, shape),
                      lambda: descending_ranks(self.score(ctx, view)))
