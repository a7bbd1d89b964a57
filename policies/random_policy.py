"""Random eviction: a control that keeps ``floor(r * T_a)`` uniformly random audio positions.

Not from a paper: it is the floor every scoring policy must beat (WnW §2.1 compares top-K
overlaps against the random baseline ``K / T_a``). The draw is seeded by ``ctx.seed`` so a run
is reproducible; each (layer, KV-head) gets an independent uniform subset of exact size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kvsim.policies._params import require_int
from kvsim.policies._scoring import uniform_head_budget
from kvsim.policies.base import (
    Policy,
    PolicyContext,
    PrefillView,
    Tier,
    descending_ranks,
    shared,
    topk_from_ranks,
)
from kvsim.policies.registry import register


@register
@dataclass
class RandomPolicy(Policy):
    """Keep a uniformly random ``floor(r * T_a)``-subset per (layer, KV-head) at prefill.

    Parameters
    ----------
    salt : int
        Mixed with ``ctx.seed`` to draw independent subsets at the same seed (0; a control,
        no paper value).
    """

    name = "random"
    paper = "Control: uniformly random audio KV eviction (WnW §2.1 random baseline)"

    salt: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "salt", self.salt)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        budget = uniform_head_budget(ctx, self.budget)
        shape = (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio)

        def ranks() -> np.ndarray:
            rng = np.random.default_rng([int(ctx.seed), int(self.salt), 0x6B7673])
            return descending_ranks(rng.random(shape))

        # the same draw at every budget (nested subsets): ranked once per prefill view
        keep = topk_from_ranks(shared(view, ("random", ctx.seed, self.salt, shape), ranks), budget)
        self._capacity = budget * ctx.heads.n_heads_total
        return np.where(keep, Tier.GPU, Tier.GONE).astype(np.uint8)

    def gpu_capacity(self) -> int | None:
        return self._capacity
