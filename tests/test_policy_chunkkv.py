"""ChunkKV: whole chunks by summed window attention, shared across a layer's heads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo_fakes import FakePrefill, make_ctx, random_prefill

from kvsim.policies import Tier, make
from kvsim.policies.chunkkv import chunk_scores, select_chunks


def test_chunk_scores_sum_and_scale_short_last_chunk() -> None:
    s = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    # chunks of 3: [1,2,3] -> 6, [4,5,6] -> 15, [7] -> 7 * 3 / 1 = 21
    assert np.allclose(chunk_scores(s, 3), [6.0, 15.0, 21.0])


def test_hand_case_keeps_best_chunks_whole() -> None:
    s = np.zeros(40)
    s[12] = 5.0  # chunk 1 (10..19) best by one strong token
    s[30:40] = 0.4  # chunk 3 total 4.0, second
    s[0:10] = 0.1  # chunk 0 total 1.0, third
    keep = select_chunks(s, 10, 20)
    assert np.flatnonzero(keep).tolist() == list(range(10, 20)) + list(range(30, 40))


def test_remainder_filled_from_next_chunk_by_token_score() -> None:
    s = np.zeros(30)
    s[0:10] = 1.0  # best chunk
    s[20:30] = [0.0, 0.9, 0.0, 0.0, 0.8, 0.0, 0.0, 0.0, 0.0, 0.0]  # next best: tokens 21, 24
    keep = select_chunks(s, 10, 12)
    assert np.flatnonzero(keep).tolist() == list(range(10)) + [21, 24]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 120),
    chunk=st.integers(1, 16),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_exact_budget_any_shape(n: int, chunk: int, frac: float, seed: int) -> None:
    s = np.random.default_rng(seed).random(n)
    budget = int(frac * n)
    keep = select_chunks(s, chunk, budget)
    assert keep.sum() == budget
    # at most one chunk is partially kept
    starts = np.arange(0, n, chunk)
    kept = np.add.reduceat(keep.astype(int), starts)
    sizes = np.minimum(starts + chunk, n) - starts
    assert ((kept > 0) & (kept < sizes)).sum() <= 1


def test_layer_heads_share_chunks_and_budget_is_met() -> None:
    ctx = make_ctx(n_layers=3, n_q_heads=8, n_kv_heads=4, n_audio=375)
    tiers = make("chunkkv", 0.2).prefill(ctx, random_prefill(ctx, n_window=8))
    keep = tiers == Tier.GPU
    for layer in range(3):
        assert (keep[layer] == keep[layer, :1]).all()
    assert ((keep.sum(axis=-1)) == 75).all()
    assert abs(keep.mean() - 0.2) <= 0.01
    assert set(np.unique(tiers)) == {Tier.GPU, Tier.GONE}


def test_share_heads_false_ranks_per_head() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=2, n_audio=20)
    att = np.zeros((1, 2, 1, 20), dtype=np.float32)
    att[0, 0, 0, 0:5] = 1.0  # head 0 likes chunk 0
    att[0, 1, 0, 15:20] = 1.0  # head 1 likes chunk 3
    view = FakePrefill(att, np.zeros((1, 2, 20, 4), dtype=np.float32))
    tiers = make("chunkkv", 0.25, chunk_size=5, share_heads=False).prefill(ctx, view)
    assert np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist() == [0, 1, 2, 3, 4]
    assert np.flatnonzero(tiers[0, 1] == Tier.GPU).tolist() == [15, 16, 17, 18, 19]
    shared = make("chunkkv", 0.25, chunk_size=5).prefill(ctx, view)
    assert (shared[0, 0] == shared[0, 1]).all()


def test_window_limits_observation_queries() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=1, n_kv_heads=1, n_audio=20)
    att = np.zeros((1, 1, 2, 20), dtype=np.float32)
    att[0, 0, 0, 0:5] = 1.0  # early query likes chunk 0
    att[0, 0, 1, 10:15] = 0.5  # last query likes chunk 2
    view = FakePrefill(att, np.zeros((1, 1, 20, 4), dtype=np.float32))
    last_only = make("chunkkv", 0.25, chunk_size=5, window=1).prefill(ctx, view)
    assert np.flatnonzero(last_only[0, 0] == Tier.GPU).tolist() == [10, 11, 12, 13, 14]
    both = make("chunkkv", 0.25, chunk_size=5, window=2).prefill(ctx, view)
    assert np.flatnonzero(both[0, 0] == Tier.GPU).tolist() == [0, 1, 2, 3, 4]


def test_bad_chunk_size() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        make("chunkkv", 0.5, chunk_size=0)
