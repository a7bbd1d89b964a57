"""Random control: exact per-head budget, reproducible by seed, uniform over positions."""

from __future__ import annotations

import numpy as np
import pytest
from zoo_fakes import make_ctx, random_prefill

from kvsim.policies import Tier, make


@pytest.mark.parametrize("r", [0.2, 0.4, 0.6, 0.8, 1.0])
def test_exact_budget_per_head(r: float) -> None:
    ctx = make_ctx(n_audio=375)
    tiers = make("random", r).prefill(ctx, random_prefill(ctx))
    per_head = (tiers == Tier.GPU).sum(axis=-1)
    assert (per_head == int(np.floor(r * 375 + 1e-9))).all()
    assert set(np.unique(tiers)) <= {Tier.GPU, Tier.GONE}
    assert abs((tiers == Tier.GPU).mean() - r) <= 0.01


def test_seeded_reproducible_and_seed_sensitive() -> None:
    view = random_prefill(make_ctx())
    a = make("random", 0.3).prefill(make_ctx(seed=5), view)
    b = make("random", 0.3).prefill(make_ctx(seed=5), view)
    c = make("random", 0.3).prefill(make_ctx(seed=6), view)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_heads_draw_independent_subsets() -> None:
    ctx = make_ctx(n_layers=3, n_kv_heads=4, n_q_heads=8, n_audio=200)
    keep = make("random", 0.5).prefill(ctx, random_prefill(ctx)) == Tier.GPU
    rows = keep.reshape(-1, 200)
    assert len({r.tobytes() for r in rows}) == rows.shape[0]


def test_uniform_over_positions() -> None:
    """Each position is kept with probability r: frequencies over many seeds stay near r."""
    n, r = 40, 0.25
    ctx0 = make_ctx(n_layers=1, n_kv_heads=1, n_q_heads=1, n_audio=n)
    view = random_prefill(ctx0)
    counts = np.zeros(n)
    draws = 800
    for seed in range(draws):
        ctx = make_ctx(n_layers=1, n_kv_heads=1, n_q_heads=1, n_audio=n, seed=seed)
        counts += make("random", r).prefill(ctx, view)[0, 0] == Tier.GPU
    freq = counts / draws
    # binomial sd = sqrt(.25*.75/800) = 0.015; 5 sd margin
    assert np.abs(freq - r).max() < 0.08
    # early and late halves are equally likely (a biased draw would skew one side)
    assert abs(freq[: n // 2].mean() - freq[n // 2 :].mean()) < 0.03
