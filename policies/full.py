"""Full cache: every audio position stays on GPU (the quality upper bound, WnW §3.3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies.base import Policy, PolicyContext, PrefillView, full_tiers
from kvsim.policies.registry import register


@register
@dataclass
class FullCache(Policy):
    """Keep all audio KV on GPU. ``budget`` is ignored (retention is always 1)."""

    name = "full"
    paper = "Full Cache (no compression); WnW §3.3"

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        return full_tiers(ctx)
