"""The score-based baselines: properties mutation testing found untested.

Hyper-parameter errors name the policy and the field; the observation window of H2O and
AudioKV is their last ``window`` queries; runs of different hyper-parameters never share a
cached score or ranking (and runs of the same ones do); PyramidKV with one layer; AudioKV's
budgets with voice scores summing to at most 1 or to 0; ChunkKV's capacity and tie order;
the allocation helper's uniform fallback and tie order over many items.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from zoo_fakes import make_ctx, random_prefill, split_window_prefill

from kvsim.core.shapes import HeadScores
from kvsim.policies import MissingCalibrationError, Tier, make
from kvsim.policies._allocation import allocate
from kvsim.policies._scoring import pool_scores, window_mass
from kvsim.policies.audiokv import spectral_smooth, voice_guided_budgets
from kvsim.policies.chunkkv import select_chunks
from kvsim.policies.pyramidkv import pyramid_layer_budgets


# ----------------------------------------------------------------------------- hyper-parameters
@pytest.mark.parametrize(
    ("name", "params", "msg"),
    [
        ("h2o", {"recent_fraction": -0.1}, r"h2o: recent_fraction must be in \[0, 1\], got -0.1"),
        ("h2o", {"recent_fraction": 1.5}, r"h2o: recent_fraction must be in \[0, 1\], got 1.5"),
        ("chunkkv", {"chunk_size": 0}, "chunkkv: chunk_size must be >= 1, got 0"),
        ("chunkkv", {"share_heads": 1}, "chunkkv: share_heads must be True or False, got 1"),
        ("audiokv", {"alpha": -0.5}, r"audiokv: alpha must be in \[0, 1\], got -0.5"),
        ("audiokv", {"alpha": 1.5}, r"audiokv: alpha must be in \[0, 1\], got 1.5"),
        ("audiokv", {"baseline_ratio": -0.1}, r"audiokv: baseline_ratio must be in \[0, 1\]"),
        ("audiokv", {"baseline_ratio": 2.0}, r"audiokv: baseline_ratio must be in \[0, 1\], got 2.0"),
    ],
)
def test_bad_hyperparameters_give_one_line_errors(name: str, params: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        make(name, 0.2, **params)


def test_range_edges_are_accepted() -> None:
    for name, params in [("h2o", {"recent_fraction": 0.0}), ("h2o", {"recent_fraction": 1.0}),
                         ("chunkkv", {"chunk_size": 1}), ("audiokv", {"alpha": 0.0}),
                         ("audiokv", {"alpha": 1.0}), ("audiokv", {"baseline_ratio": 0.0}),
                         ("audiokv", {"baseline_ratio": 1.0})]:
        make(name, 0.2, **params)


def test_audiokv_without_head_scores_names_itself() -> None:
    ctx = make_ctx()
    with pytest.raises(MissingCalibrationError, match="policy 'audiokv' needs per-head"):
        make("audiokv", 0.2).prefill(ctx, random_prefill(ctx))


# ----------------------------------------------------------------------------- observation window
def test_h2o_seeds_its_scores_with_its_last_window_queries() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=40)
    pol = make("h2o", 0.125, window=2, recent_fraction=0.0)  # 5 heavy hitters per head
    tiers = pol.prefill(ctx, split_window_prefill())
    assert (pol.scores[0, 0, :30] == 0).all() and (pol.scores[0, 0, 30:35] == 4.0).all()
    assert np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist() == [30, 31, 32, 33, 34]


def test_audiokv_scores_its_last_window_queries() -> None:
    ctx = replace(make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=40),
                  head_scores=HeadScores(np.ones((1, 1)), np.ones((1, 1))))
    pol = make("audiokv", 0.125, window=2, alpha=0.0)  # alpha 0: the raw window score
    score = pol.score(ctx, split_window_prefill())
    assert (score[0, 0, :30] == 0).all() and (score[0, 0, 30:35] == 4.0).all()


def test_window_mass_of_more_queries_than_audio_tokens() -> None:
    """The last ``window`` queries, also when the audio is shorter than the window."""
    att = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)
    np.testing.assert_array_equal(window_mass(att, 4), att[:, 4:].sum(axis=1, dtype=np.float64))


def test_pool_scores_averages_by_default() -> None:
    x = np.array([0.0, 3.0, 0.0, 0.0])
    np.testing.assert_allclose(pool_scores(x, 3), [1.0, 1.0, 1.0, 0.0])


# ----------------------------------------------------------------------------- shared results
_VARIANTS = [
    ("snapkv", {}), ("snapkv", {"window": 2}), ("snapkv", {"kernel": 3}),
    ("adakv", {}), ("adakv", {"window": 2}), ("adakv", {"kernel": 1}),
    ("audiokv", {}), ("audiokv", {"alpha": 0.9}), ("audiokv", {"window": 2}),
    ("streaming", {}), ("streaming", {"n_sink": 9}),
    ("pyramidkv", {"pooling": "max"}), ("chunkkv", {"window": 3}), ("h2o", {"window": 2}),
]


def test_variants_in_one_pass_select_what_they_select_alone() -> None:
    """Scores and rankings are cached per prefill view for the runs of one pass: a run in
    company of other hyper-parameters gets what it gets alone."""
    rng = np.random.default_rng(0)
    ctx = replace(make_ctx(n_layers=3, n_q_heads=4, n_kv_heads=2, n_audio=90),
                  head_scores=HeadScores(rng.uniform(0.1, 1, (3, 2)), rng.uniform(0.1, 1, (3, 2))))
    base = random_prefill(ctx, n_window=6, seed=1)
    shared = replace(base, memo={})
    for r in (0.1, 0.3):
        together = [make(name, r, **kw).prefill(ctx, shared) for name, kw in _VARIANTS]
        for (name, kw), got in zip(_VARIANTS, together, strict=True):
            alone = make(name, r, **kw).prefill(ctx, replace(base, memo={}))
            np.testing.assert_array_equal(got, alone, err_msg=f"{name} {kw} at r={r}")
    assert len(shared.memo) < 2 * len(_VARIANTS)  # the second budget reused the first's


# ----------------------------------------------------------------------------- budgets
def test_pyramid_of_one_layer_is_the_flat_budget_clipped_to_the_audio() -> None:
    assert pyramid_layer_budgets(12, 1, 100, 20.0).tolist() == [12]
    assert pyramid_layer_budgets(12, 1, 10, 20.0).tolist() == [10]
    two = pyramid_layer_budgets(12, 2, 100, 20.0)
    assert two.tolist() == sorted(two.tolist(), reverse=True) and int(two.sum()) == 24
    assert two[0] > two[1]


def test_voice_guided_budgets_with_small_and_zero_voice_scores() -> None:
    """Shares in proportion to VS also when VS sums to less than 1; all-zero VS is uniform."""
    got = voice_guided_budgets(40, np.array([0.1, 0.3]), 100, baseline_ratio=0.0)
    assert got.tolist() == [10, 30]
    assert voice_guided_budgets(40, np.zeros(4), 100, baseline_ratio=0.0).tolist() == [10] * 4


def test_spectral_smooth_mixes_in_float64() -> None:
    """A float32 score is mixed as its float64 value (no float32 product on the way)."""
    x = np.random.default_rng(1).random((2, 33)).astype(np.float32)
    np.testing.assert_array_equal(spectral_smooth(x, 0.3, 0.7),
                                  spectral_smooth(x.astype(np.float64), 0.3, 0.7))


def test_chunkkv_capacity_is_its_budget() -> None:
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=400)
    pol = make("chunkkv", 0.25)
    tiers = pol.prefill(ctx, random_prefill(ctx))
    assert pol.gpu_capacity() == 100 * ctx.heads.n_heads_total == int((tiers == Tier.GPU).sum())



def test_chunkkv_ties_go_to_the_earlier_chunk_and_token() -> None:
    """38 equal chunks and two lower ones: the first 10 of the equal chunks; in a partial
    chunk of 40 tokens, the earliest of the equal tokens (NumPy's default sort orders ties
    otherwise at these lengths)."""
    scores = np.ones(400)
    scores[30:40] = scores[70:80] = 0.0  # chunks 3 and 7
    keep = select_chunks(scores, 10, 100)
    chunks = [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
    assert keep.dtype == bool
    assert np.flatnonzero(keep).tolist() == [10 * c + i for c in chunks for i in range(10)]
    scores = np.concatenate([np.full(40, 2.0), np.ones(40)])
    scores[[43, 47]] = 0.0
    keep = select_chunks(scores, 40, 50)  # chunk 0 whole, then 10 tokens of chunk 1
    assert np.flatnonzero(keep).tolist() == [*range(40), *(40 + t for t in chunks)]


# ----------------------------------------------------------------------------- allocation
def test_allocation_error_text_is_the_whole_line() -> None:
    with pytest.raises(ValueError, match=r"^allocate: weights must be finite and non-negative$"):
        allocate(3, np.array([1.0, -1.0]), 5)


def test_allocation_uniform_fallback_counts_every_item_with_room() -> None:
    """Only a zero-cap item has weight: the total is spread over the items with room, the one
    of cap 1 included."""
    assert allocate(3, np.array([0.0, 0.0, 2.0]), np.array([5, 1, 0])).tolist() == [2, 1, 0]


def test_allocation_ties_go_to_the_lower_index_among_many() -> None:
    """40 equal remainders, two items without room: the first 10 with room get the extra
    token (NumPy's default sort orders ties otherwise at this length)."""
    caps = np.ones(40, dtype=np.int64)
    caps[[3, 7]] = 0
    got = allocate(10, np.ones(40), caps)
    assert np.flatnonzero(got).tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10, 11]
