"""RecentHeavy: a user's scoring policy, written outside kvsim's policies/ folder.

Score = observation-window attention (summed over the window and the GQA group, as SnapKV
votes) plus a recency bonus that grows linearly to ``recency`` at the last audio token. Each
(layer, KV-head) keeps its top ``floor(r * T_a)`` audio positions (the ScoringPolicy default).

Replay it from the repository root:
    python -m kvsim replay -p examples.my_policy.recent_heavy:RecentHeavy:recency=0.2 -b 0.2,0.4
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies.base import PolicyContext, PrefillView, kv_group_sum
from kvsim.policies.scoring import ScoringPolicy


@dataclass
class RecentHeavy(ScoringPolicy):
    """Heavy hitters of the observation window, nudged towards the end of the audio.

    Parameters
    ----------
    recency : float
        Bonus of the last audio position, in units of the mean attention per position
        (0 = pure observation-window attention).
    """

    name = "recent_heavy"
    paper = "Example: observation-window attention plus a recency bonus"

    recency: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.recency, int | float) and self.recency >= 0):
            raise ValueError(f"{self.name}: recency must be a number >= 0, got {self.recency!r}")

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        attention = np.stack([  # (L, H_kv, T_a): window queries and GQA group summed
            kv_group_sum(view.audio_attention(layer).sum(axis=1, dtype=np.float64),
                         ctx.heads.group)
            for layer in range(ctx.heads.n_layers)])
        ramp = np.linspace(0.0, 1.0, ctx.n_audio)  # 0 at the first audio token, 1 at the last
        mean = attention.mean(axis=-1, keepdims=True)
        return attention + self.recency * mean * ramp
