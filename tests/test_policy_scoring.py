"""The scoring contract (``ScoringPolicy``): a subclass writes ``score`` only; the base keeps
each head's top budget, marks the rest GONE and declares the kept total as its capacity.

Every comparison here is of integers or booleans (tiers, masks, counts): exact by
construction, nothing depends on float rounding."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvsim.policies._scoring import pool_scores, pooled_window_scores, window_scores
from kvsim.policies.adakv import AdaKV
from kvsim.policies.base import PolicyContext, PrefillView, Tier, topk_mask
from kvsim.policies.pyramidkv import PyramidKV
from kvsim.policies.scoring import ScoringPolicy
from kvsim.policies.snapkv import SnapKV
from kvsim.policies.streaming import StreamingLLM
from tests.zoo_fakes import FakePrefill, make_ctx, split_window_prefill


def _prefill(ctx: PolicyContext, seed: int = 0, window: int = 6) -> FakePrefill:
    rng = np.random.default_rng(seed)
    h = ctx.heads
    att = rng.random((h.n_layers, h.n_q_heads, window, ctx.n_audio)).astype(np.float32)
    keys = rng.standard_normal((h.n_layers, h.n_kv_heads, ctx.n_audio, h.head_dim))
    return FakePrefill(att / att.sum(-1, keepdims=True), keys.astype(np.float32))


@dataclass
class _Given(ScoringPolicy):
    """Scores handed in by the test (with ties: integers in a small range)."""

    name = "_given"
    scores: object = None
    budgets: object = None

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        return self.scores

    def head_budgets(self, ctx: PolicyContext, view: PrefillView):
        return super().head_budgets(ctx, view) if self.budgets is None else self.budgets


@pytest.mark.parametrize("budget", [0.05, 0.3, 0.77, 1.0])
def test_base_keeps_each_heads_top_budget_and_declares_it(budget: float) -> None:
    ctx = make_ctx(n_layers=3, n_kv_heads=2, n_audio=41)
    scores = np.random.default_rng(1).integers(0, 5, (3, 2, 41)).astype(float)  # many ties
    pol = _Given(budget=budget, scores=scores)
    tiers = pol.prefill(ctx, _prefill(ctx))
    k = int(np.floor(budget * 41 + 1e-9))
    assert tiers.dtype == np.uint8 and tiers.shape == (3, 2, 41)
    np.testing.assert_array_equal(tiers == Tier.GPU, topk_mask(scores, k))
    assert set(np.unique(tiers)) <= {Tier.GONE, Tier.GPU}
    assert pol.gpu_capacity() == k * 3 * 2 == (tiers == Tier.GPU).sum()
    # ties go to the earlier position: among equal scores, kept ones precede dropped ones
    for row_s, row_t in zip(scores.reshape(-1, 41), tiers.reshape(-1, 41), strict=True):
        for v in np.unique(row_s):
            kept = np.flatnonzero((row_s == v) & (row_t == Tier.GPU))
            gone = np.flatnonzero((row_s == v) & (row_t == Tier.GONE))
            assert not kept.size or not gone.size or kept.max() < gone.min()


def test_per_layer_and_per_head_budgets_are_applied_and_summed() -> None:
    ctx = make_ctx(n_layers=3, n_kv_heads=2, n_audio=20)
    scores = np.random.default_rng(2).random((3, 2, 20))
    per_layer = np.array([[0], [7], [20]])
    pol = _Given(budget=0.5, scores=scores, budgets=per_layer)
    kept = pol.prefill(ctx, _prefill(ctx)) == Tier.GPU
    np.testing.assert_array_equal(kept.sum(-1), np.broadcast_to(per_layer, (3, 2)))
    assert pol.gpu_capacity() == 2 * (0 + 7 + 20)
    per_head = np.array([[1, 2], [3, 4], [5, 6]])
    pol = _Given(budget=0.5, scores=scores, budgets=per_head)
    np.testing.assert_array_equal((pol.prefill(ctx, _prefill(ctx)) == Tier.GPU).sum(-1), per_head)
    assert pol.gpu_capacity() == 21


@pytest.mark.parametrize(("scores", "budgets", "needle"), [
    (np.zeros((2, 2, 9)), None, "score() returned shape (2, 2, 9)"),
    (np.full((2, 2, 10), np.nan), None, "without NaN"),
    (np.zeros((2, 2, 10)), np.array([[11]]), "[0, T_a=10]"),
    (np.zeros((2, 2, 10)), np.array([[-1]]), "[0, T_a=10]"),
    (np.zeros((2, 2, 10)), np.array([2.5]), "must return integers"),
    (np.zeros((2, 2, 10)), np.array([1, 2, 3]), "does not broadcast"),
])
def test_a_wrong_score_or_budget_is_one_clear_error(scores, budgets, needle: str) -> None:
    ctx = make_ctx(n_layers=2, n_kv_heads=2, n_audio=10)
    with pytest.raises(ValueError, match="^_given: ") as err:
        _Given(budget=0.5, scores=scores, budgets=budgets).prefill(ctx, _prefill(ctx))
    assert needle in str(err.value)


@pytest.mark.parametrize("n_audio", [1, 7, 50])
@pytest.mark.parametrize("n_sink", [0, 1, 4, 60])
@pytest.mark.parametrize("budget", [0.01, 0.1, 0.5, 1.0])
def test_streaming_as_a_scorer_is_sinks_plus_recent(n_audio: int, n_sink: int,
                                                    budget: float) -> None:
    """StreamingLLM's score ranks sinks first, then recency: the top-B is exactly the first
    ``min(n_sink, B)`` audio positions and the last ``B - min(n_sink, B)``."""
    ctx = make_ctx(n_audio=n_audio)
    b = int(np.floor(budget * n_audio + 1e-9))
    sink = min(n_sink, b)
    want = np.zeros(n_audio, dtype=bool)
    want[:sink] = True
    if b > sink:
        want[n_audio - (b - sink):] = True
    pol = StreamingLLM(budget=budget, n_sink=n_sink)
    kept = pol.prefill(ctx, _prefill(ctx)) == Tier.GPU
    np.testing.assert_array_equal(kept, np.broadcast_to(want, kept.shape))
    assert want.sum() == b and pol.gpu_capacity() == b * ctx.heads.n_heads_total


@pytest.mark.parametrize("budget", [0.1, 0.4, 0.9])
def test_flat_allocations_of_snapkv_subclasses_are_snapkv(budget: float) -> None:
    """PyramidKV and Ada-KV override only the allocation: with a flat pyramid (beta = 1) or a
    fully uniform safeguard (floor_alpha = 1) they keep exactly SnapKV's positions."""
    ctx = make_ctx(n_layers=4, n_q_heads=8, n_kv_heads=2, n_audio=64)
    view = _prefill(ctx, seed=5)
    snap = SnapKV(budget=budget, pooling="max").prefill(ctx, view)
    np.testing.assert_array_equal(PyramidKV(budget=budget, beta=1.0, pooling="max")
                                  .prefill(ctx, view), snap)
    np.testing.assert_array_equal(AdaKV(budget=budget, floor_alpha=1.0).prefill(ctx, view), snap)
    assert AdaKV.hyperparameters()["pooling"] == "max" != SnapKV.hyperparameters()["pooling"]
    # and the non-flat allocations do differ (the test is not vacuous)
    steep = PyramidKV(budget=budget, beta=20.0, pooling="max").prefill(ctx, view)
    assert not np.array_equal(steep, snap)


def _view(att: np.ndarray) -> FakePrefill:
    """A prefill view over hand-made (L, H_q, W, T_a) attention (keys unused here)."""
    n_layers, _, _, n_audio = att.shape
    return FakePrefill(att.astype(np.float32), np.zeros((n_layers, 1, n_audio, 8), np.float32))


def test_snapkv_votes_with_its_last_window_queries_only() -> None:
    """SnapKV's observation window is the last ``window`` prompt queries: earlier rows of the
    view do not vote, and ``score`` is the pooled attention they give (not its ranks)."""
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=40)
    pol = SnapKV(budget=0.125, window=2, kernel=1)  # 5 tokens per head
    tiers = pol.prefill(ctx, split_window_prefill())
    assert np.flatnonzero(tiers[0, 0] == Tier.GPU).tolist() == [30, 31, 32, 33, 34]
    score = pol.score(ctx, split_window_prefill())
    assert (score[0, 0, 30:35] > 0).all() and (score[0, 0, :30] == 0).all()


def test_window_scores_sum_in_float64_and_are_read_only() -> None:
    """The window and GQA sums are float64 (a float32 sum of 1 and 1e-8 is 1); the shared
    result cannot be changed by the policy that reads it."""
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=6)
    att = np.zeros((1, 2, 2, 6))
    att[0, 0, :, 3], att[0, 1, :, 3] = 1.0, 1e-8
    view = _view(att)
    one = np.float64(np.float32(1.0)) * 2 + np.float64(np.float32(1e-8)) * 2
    assert window_scores(ctx, view)[0, 0, 3] == one
    for arr in (window_scores(ctx, view), *pooled_window_scores(ctx, view, None, 3, "max")):
        assert not arr.flags.writeable


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pooling_runs_along_positions_with_edge_replication(kind) -> None:
    """A centred window along the last axis of an (L, H, T) array, the edges padded with the
    end value (``mode="nearest"``); kernel 2 already pools."""
    x = np.zeros((2, 3, 8))
    x[1, 2] = [6.0, 0, 0, 0, 0, 0, 0, 3.0]
    got = pool_scores(x, 5, kind)
    assert (got[0] == 0).all() and (got[1, :2] == 0).all()  # no pooling across rows
    if kind == "avg":  # position 0 sees 6, 6, 6, 0, 0
        assert got[1, 2, 0] == pytest.approx(18 / 5) and got[1, 2, 7] == pytest.approx(9 / 5)
    else:
        assert got[1, 2, :3].tolist() == [6.0] * 3 and got[1, 2, 5:].tolist() == [3.0] * 3
    assert pool_scores(x, 2, kind)[1, 2, 1] > 0  # kernel 2 spreads position 0 onto 1
    with pytest.raises(ValueError, match="pooling must be 'avg' or 'max', got 'min'"):
        pool_scores(x, 3, "min")


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_snapkv_score_is_the_pooled_window_score(kind) -> None:
    from kvsim.policies._scoring import pool_scores, window_scores
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=30)
    view = _prefill(ctx)
    got = SnapKV(budget=0.3, kernel=5, pooling=kind).score(ctx, view)
    np.testing.assert_array_equal(got, pool_scores(window_scores(ctx, view), 5, kind))


def test_a_scoring_policy_with_bad_scores_or_ranks_gets_one_line_errors() -> None:
    """What a user's ScoringPolicy returns is checked: shape, real numbers without NaN, and
    the shape of overridden ranks; the capacity is known only after prefill."""
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, n_audio=10)
    view = _prefill(ctx)
    pol = _Given(budget=0.5, scores=np.zeros((1, 1, 10)))
    assert pol.gpu_capacity() is None
    pol.prefill(ctx, view)
    assert pol.gpu_capacity() == 5
    bad = [(np.full((1, 1, 10), np.nan), r"_given: score\(\) must return real numbers without NaN"),
           (np.full((1, 1, 10), "a"), r"_given: score\(\) must return real numbers without NaN"),
           (np.zeros((1, 1, 9)), r"_given: score\(\) returned shape \(1, 1, 9\)")]
    for scores, msg in bad:
        with pytest.raises(ValueError, match=msg):
            _Given(budget=0.5, scores=scores).prefill(ctx, view)

    @dataclass
    class _BadRanks(_Given):
        def ranks(self, ctx, view):
            return np.zeros((1, 1, 9), dtype=np.int64)

    with pytest.raises(ValueError, match=r"_given: ranks have shape \(1, 1, 9\), expected"):
        _BadRanks(budget=0.5, scores=np.zeros((1, 1, 10))).prefill(ctx, view)


def test_a_scoring_policy_scores_from_its_context_and_view_in_integers_or_floats() -> None:
    """The default ranks pass the context and the view to score(); integer scores are real
    numbers too."""
    @dataclass
    class _Window(ScoringPolicy):
        name = "_window"

        def score(self, ctx, view):
            return window_scores(ctx, view)

    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=30)
    view = _prefill(ctx)
    tiers = _Window(budget=0.2).prefill(ctx, view)
    np.testing.assert_array_equal(tiers == Tier.GPU, topk_mask(window_scores(ctx, view), 6))
    ints = np.arange(30)[::-1].reshape(1, 1, 30).repeat(2, 0).repeat(2, 1)
    kept = _Given(budget=0.2, scores=ints).prefill(ctx, view) == Tier.GPU
    assert (np.flatnonzero(kept[0, 0]) == np.arange(6)).all()
