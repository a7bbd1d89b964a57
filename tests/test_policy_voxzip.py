"""VoxZip stage 2 unit tests: the decay recurrence, prefill seeding, sink/recent/top-N split."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies.base import Tier
from kvsim.policies.registry import make
from kvsim.policies.voxzip import decayed_accumulate, sink_recent_topn
from tests._zoo_a_views import FakePrefillView, make_ctx, random_prefill


def test_decay_recurrence_hand_case() -> None:
    a = decayed_accumulate(np.array([1.0, 2.0]), np.array([0.1, 0.2, 0.3]), 0.5)
    np.testing.assert_allclose(a, [0.6, 1.2, 0.3])  # γ·[A, 0] + softmax row
    b = decayed_accumulate(a, np.array([0.0, 0.0, 1.0]), 0.5)
    np.testing.assert_allclose(b, [0.3, 0.6, 1.15])
    with pytest.raises(ValueError, match="fewer"):
        decayed_accumulate(np.ones(3), np.ones(2), 0.9)


def test_gamma_one_is_plain_accumulation() -> None:
    rows = np.random.default_rng(0).uniform(size=(5, 7))
    a = np.zeros(7)
    for r in rows:
        a = decayed_accumulate(a, r, 1.0)
    np.testing.assert_allclose(a, rows.sum(0))


def test_prefill_seed_decays_window_queries_and_sums_gqa_group() -> None:
    ctx = make_ctx(1, 4, 2, 50)
    att = np.zeros((1, 4, 3, 50))
    rng = np.random.default_rng(1)
    att[:] = rng.uniform(size=att.shape)
    pol = make("voxzip", 0.5, gamma=0.5)
    pol.prefill(ctx, FakePrefillView(att))
    grp = att[0].reshape(2, 2, 3, 50).sum(1)  # (H_kv, W, T_a)
    want = 0.25 * grp[:, 0] + 0.5 * grp[:, 1] + grp[:, 2]
    np.testing.assert_allclose(pol.scores_[0], want, rtol=1e-6)


def test_sinks_recent_and_topn_partition_the_budget() -> None:
    ctx = make_ctx(2, 4, 2, 100)
    view = random_prefill(ctx)
    pol = make("voxzip", 0.3)
    tiers = pol.prefill(ctx, view)
    b = 30
    gpu = tiers == Tier.GPU
    assert (gpu.sum(-1) == b).all()  # floor(r T_a) per (layer, kv-head)
    assert gpu[..., :4].all()  # T = 4 sinks
    assert gpu[..., 100 - 6 :].all()  # recent window = 20% of 30
    mid = pol.scores_[..., 4:94]
    kept = gpu[..., 4:94]
    for lh in np.ndindex(2, 2):
        assert kept[lh].sum() == b - 4 - 6
        assert mid[lh][kept[lh]].min() >= mid[lh][~kept[lh]].max()
    assert set(np.unique(tiers)) <= {Tier.GPU, Tier.GONE}
    assert pol.gpu_capacity() == b * 4


def test_tiny_budget_gives_sinks_first() -> None:
    keep = sink_recent_topn(np.random.default_rng(0).uniform(size=(1, 20)), 3, 4, 0.2)
    assert keep[0].tolist() == [True] * 3 + [False] * 17


def test_decode_rule_never_grows_and_respects_residency() -> None:
    ctx = make_ctx(1, 2, 1, 60)
    pol = make("voxzip", 0.25)
    pol.prefill(ctx, random_prefill(ctx))
    before = pol._keep.copy()
    att = np.zeros((2, 60))
    att[:, 30] = 1.0  # a position that may already be gone
    after = pol.update_scores([att])
    assert (after <= before).all() and after.sum() == before.sum()
    assert pol.scores_[0, 0, 30] >= 2.0 * 1.0 - 1e-9  # group sum added to the decayed score
