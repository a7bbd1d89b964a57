"""A user's own test of RecentHeavy: kvsim's invariant checks, run on it.

Run from the repository root: ``python -m pytest examples/my_policy/test_recent_heavy.py``.
"""

from __future__ import annotations

from examples.my_policy.recent_heavy import RecentHeavy
from kvsim.testing import check_policy


def test_recent_heavy_keeps_the_protocol() -> None:
    runs = check_policy(RecentHeavy, params={"recency": 0.2}, budgets=(0.2, 0.6))
    # a static prefill-only policy keeps floor(r * T_a) per head: r_GPU within a token per head
    for run in runs:
        assert abs(run.summary["r_gpu"] - run.spec.budget) < 0.05
