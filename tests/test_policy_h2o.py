"""H2O: heavy hitters + recent audio window, accumulated scores, budget at every step."""

from __future__ import annotations

import numpy as np
import pytest
from zoo_fakes import FakePrefill, FakeStep, drive, make_ctx, random_prefill

from policies import Tier, make
from policies.base import kv_group_sum


def _hand_view(scores_per_q: np.ndarray, n_layers: int = 1) -> FakePrefill:
    """A prefill view whose single-query attention is ``scores_per_q`` (H_q, T_a)."""
    att = np.broadcast_to(
        scores_per_q[None, :, None, :],
        (n_layers, *scores_per_q.shape[:1], 1, scores_per_q.shape[1]),
    )
    keys = np.zeros((n_layers, 1, scores_per_q.shape[1], 4), dtype=np.float32)
    return FakePrefill(np.ascontiguousarray(att, dtype=np.float32), keys)


def test_hand_case_heavy_plus_recent() -> None:
    # T_a = 10, r = 0.4 -> B = 4: 2 recent (positions 8, 9) + 2 heavy hitters
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=10)
    s = np.array([[0.0, 0.3, 0.0, 0.0, 0.0, 0.2, 0.1, 0.0, 0.5, 0.0]] * 2)
    s[1, 6] = 0.25  # only one q-head of the group likes position 6: group sum 0.35 < 0.4
    tiers = make("h2o", 0.4).prefill(ctx, _hand_view(s))
    kept = np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist()
    # group sums: p1 .6, p5 .4, p6 .35, p8 1.0 (recent anyway) -> heavy = {1, 5}
    assert kept == [1, 5, 8, 9]
    assert set(np.unique(tiers)) == {Tier.GPU, Tier.GONE}


def test_recent_fraction_zero_is_pure_heavy_hitters() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=1, n_kv_heads=1, n_audio=8)
    s = np.array([[0.1, 0.9, 0.0, 0.5, 0.2, 0.0, 0.0, 0.05]])
    tiers = make("h2o", 0.25, recent_fraction=0.0).prefill(ctx, _hand_view(s))
    assert np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist() == [1, 3]


def test_scores_accumulate_step_attention() -> None:
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=30)
    view = random_prefill(ctx, n_window=3)
    pol = make("h2o", 0.5)
    pol.prefill(ctx, view)
    expected = np.stack(
        [kv_group_sum(view.attention[layer].sum(axis=1, dtype=np.float64), 2) for layer in range(2)]
    )
    assert np.allclose(pol.scores, expected)
    rng = np.random.default_rng(3)
    for step in range(4):
        att = rng.random((2, 4, 30)).astype(np.float32)
        assert pol.decode_step(FakeStep(step, att)) is None  # within budget: nothing evicted
        expected += np.stack([kv_group_sum(att[layer].astype(np.float64), 2) for layer in range(2)])
    assert np.allclose(pol.scores, expected)


def test_eviction_rule_drops_lowest_accumulated_non_recent() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=1, n_kv_heads=1, n_audio=10)
    pol = make("h2o", 0.4)  # B = 4, recent = {8, 9}
    pol.prefill(ctx, _hand_view(np.zeros((1, 10))))
    pol.scores[0, 0] = np.arange(10, dtype=np.float64)[::-1]  # position 0 highest
    over = np.zeros((1, 1, 10), dtype=bool)
    over[0, 0, [2, 3, 4, 8, 9]] = True  # 5 resident > B
    out = pol._evict(over)
    assert np.flatnonzero(out[0, 0] == Tier.GPU).tolist() == [2, 3, 8, 9]
    assert not ((out == Tier.GPU) & ~over).any()  # never re-admits


def test_budget_every_step_and_gone_absorbing() -> None:
    ctx = make_ctx(n_audio=64)
    pol = make("h2o", 0.3)
    log = drive(pol, ctx, random_prefill(ctx), n_steps=6)
    b = int(np.floor(0.3 * 64))
    for prev, cur in zip(log.tiers, log.tiers[1:], strict=False):
        assert ((cur == Tier.GPU).sum(axis=-1) <= b).all()
        assert not ((prev == Tier.GONE) & (cur != Tier.GONE)).any()
    assert (log.tiers[0] == Tier.GPU).sum() <= pol.gpu_capacity()


def test_bad_hyperparameter_is_clear() -> None:
    with pytest.raises(ValueError, match="recent_fraction"):
        make("h2o", 0.3, recent_fraction=1.5)
