"""WnW edge cases found by mutation testing (mutmut on policies/wnw.py, policies/_wnw_layout.py).

Each test fails for a class of code changes that the rest of the suite let through: boundary
comparisons of the budget, the head-count defaults, the anchor fallback order, the λ solve's
saturation and ordering, the worst-case capacity, multi-layer anchors in eq. (2).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kvsim.policies._wnw_layout import (
    ANCHOR,
    TIDAL,
    SegmentLayout,
    count_prefill_gpu,
    fit_lambda_mean,
    normalised_importance,
    solve_lambda,
    triage,
)
from kvsim.policies.base import Tier
from kvsim.policies.registry import make
from kvsim.policies.wnw import WnWBudgetWarning
from tests._zoo_a_views import FakeStepView, focused_step, make_ctx, random_prefill

VS4 = np.array([[1.0, 0.8], [0.5, 0.2]])


def _quiet_prefill(pol, ctx, view=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WnWBudgetWarning)
        return pol.prefill(ctx, view if view is not None else random_prefill(ctx))


# ----------------------------------------------------------------------------- head counts
@pytest.mark.parametrize(("r", "n_voice"), [(0.2, 90), (0.4, 50), (0.6, 30), (0.8, 30)])
def test_default_head_counts_on_voxtral_shape(r: float, n_voice: int) -> None:
    """§3.4: n_voice {90, 50, 30, 30} of 240 heads; 5 anchors."""
    assert make("wnw", r).head_counts(240) == (n_voice, 5)


def test_explicit_head_counts_are_clipped_not_raised() -> None:
    assert make("wnw", 0.2, n_voice=0).head_counts(240) == (0, 0)  # no voice heads at all
    assert make("wnw", 0.2, n_voice=500, n_anchor=3).head_counts(240) == (240, 3)
    assert make("wnw", 0.2, n_voice=2).head_counts(240) == (2, 2)  # anchors ⊆ voice heads


# ----------------------------------------------------------------------------- eq. (2)
def test_anchor_scores_sum_over_anchors_in_different_layers() -> None:
    vs = np.array([[1.0, 0.1], [0.9, 0.2]])  # anchors: (0, 0) and (1, 0)
    ctx = make_ctx(voice_score=vs)
    pol = make("wnw", 0.6, n_voice=3, n_anchor=2)
    _quiet_prefill(pol, ctx)
    att = np.random.default_rng(0).uniform(size=(2, 4, 100))
    expected = att[0, 0] + att[0, 1] + att[1, 0] + att[1, 1]
    np.testing.assert_allclose(pol.anchor_scores(FakeStepView(0, att)), expected, rtol=1e-6)


# ----------------------------------------------------------------------------- decode output
def test_tiers_are_uint8_and_an_unchanged_step_returns_none() -> None:
    ctx = make_ctx(2, 4, 2, 200, voice_score=VS4)
    pol = make("wnw", 0.6, n_voice=3, n_anchor=1, top_k=1, lam=0.5)
    t0 = pol.prefill(ctx, random_prefill(ctx))
    assert t0.dtype == np.uint8
    t1 = pol.decode_step(focused_step(ctx, 0, 150, 200))
    assert t1 is not None and t1.dtype == np.uint8
    assert pol.decode_step(focused_step(ctx, 1, 150, 200)) is None  # same selection: no move


# ----------------------------------------------------------------------------- step mode
def test_step_mode_explicit_lam_may_fill_the_budget_exactly() -> None:
    ctx = make_ctx(voice_score=VS4)
    s = normalised_importance(VS4)
    lay = SegmentLayout.from_seconds(100, 12.5, 4.0, 2.0)
    used = count_prefill_gpu(s, triage(VS4, 3, 1), lay.seg_len, 1.5, 0)
    budget = used / ctx.audio_kv_total  # a target whose budget is exactly the prefill count
    pol = make("wnw", budget, n_voice=3, n_anchor=1, lam=1.5, budget_mode="step")
    assert ctx.budget_tokens(budget) == used
    tiers = _quiet_prefill(pol, ctx)
    assert int((tiers == Tier.GPU).sum()) == used == pol.gpu_capacity()
    assert pol.lam_source_ == "given"


def test_step_mode_full_budget_prefill_equals_capacity() -> None:
    ctx = make_ctx(voice_score=VS4)
    pol = make("wnw", 1.0, n_voice=3, n_anchor=1, budget_mode="step")
    tiers = _quiet_prefill(pol, ctx)
    assert int((tiers == Tier.GPU).sum()) == pol.gpu_capacity() == ctx.audio_kv_total
    assert pol.lam_source_ == "input" and pol.solve_.saturated


def test_step_mode_with_room_for_a_recall_does_not_warn(recwarn) -> None:
    ctx = make_ctx(2, 4, 2, 400, voice_score=VS4)
    make("wnw", 0.6, n_voice=3, n_anchor=1, budget_mode="step").prefill(ctx, random_prefill(ctx))
    assert not [w for w in recwarn if issubclass(w.category, WnWBudgetWarning)]


# ----------------------------------------------------------------------------- anchor fallback
def _anchors_after(ctx, r: float, **kw) -> tuple[int, int]:
    pol = make("wnw", r, **kw)
    _quiet_prefill(pol, ctx)
    return int((pol.roles_ == ANCHOR).sum()), pol.min_per_segment_


def test_anchor_fallback_order() -> None:
    """Fewest anchors removed first, then the floor, then anchors; exact budgets fit."""
    # 8 heads, T_a = 100, 4 segments of 25: N = 800 audio KV tokens
    ctx = make_ctx(4, 4, 2, 100, voice_score=np.linspace(1, 0.3, 8).reshape(4, 2))
    # 2 anchors + 6 heads x 1 x 4 segments = 224 tokens: exactly 0.28 of 800 fits
    assert _anchors_after(ctx, 0.28, n_voice=6, n_anchor=3, min_per_segment=1) == (2, 1)
    assert _anchors_after(ctx, 0.279, n_voice=6, n_anchor=3, min_per_segment=1) == (1, 1)
    # 1 anchor + 7·4 = 128 > 120 = 0.15·800, but 1 anchor without the floor fits
    assert _anchors_after(ctx, 0.15, n_voice=6, n_anchor=2, min_per_segment=1) == (1, 0)
    # at 0.1 (80 tokens) no anchor fits (100 each); the floor alone (8 · 4 = 32) would
    assert _anchors_after(ctx, 0.1, n_voice=6, n_anchor=1, min_per_segment=1) == (0, 0)
    assert _anchors_after(ctx, 0.1, n_voice=6, n_anchor=0, min_per_segment=1) == (0, 1)
    assert _anchors_after(ctx, 0.03, n_voice=6, n_anchor=0, min_per_segment=1) == (0, 0)
    assert _anchors_after(ctx, 0.5, n_voice=6, n_anchor=0) == (0, 0)


# ----------------------------------------------------------------------------- λ solves
def test_solve_lambda_reserve_takes_the_most_expensive_segments() -> None:
    s = np.array([1.0, 0.5])
    roles = np.array([ANCHOR, 1])  # one anchor, one tidal head
    seg_len = np.array([25, 25, 10])
    res = solve_lambda(s, roles, seg_len, budget_tokens=10_000, reserve_segments=1,
                       min_per_segment=0)
    assert res.saturated and res.lam == 2.0  # 1 / the smallest positive s̃ of a non-anchor
    res = solve_lambda(s, roles, seg_len, budget_tokens=90, reserve_segments=1,
                       min_per_segment=0)
    assert not res.saturated
    kept = np.floor(0.5 * res.lam * seg_len + 1e-9)
    assert res.reserve == int((seg_len - kept).max())  # the largest cost, a full segment
    assert res.prefill_gpu + res.reserve <= 90


def test_lambda_fits_ignore_zero_importance_and_anchor_heads() -> None:
    s = np.array([1.0, 0.0, 0.25, 0.5])  # a zero-importance head must not make λ infinite
    roles = np.array([ANCHOR, 1, 1, 0])
    seg_len = np.array([25, 25])
    res = solve_lambda(s, roles, seg_len, 10_000, 0, 0)
    assert res.lam == 4.0  # 1 / 0.25: the anchor's s̃ = 1 and the zero head do not count
    assert fit_lambda_mean([(s, roles, seg_len)], 1.0, 0) == 4.0  # saturated: exactly 1/0.25
    lam = fit_lambda_mean([(s, roles, seg_len)], 0.5, 0)
    assert 0 < lam < 4.0 and np.isfinite(lam)


def test_fit_lambda_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="wnw: no calibration inputs"):
        fit_lambda_mean([], 0.2, 0)
    s, roles, seg_len = np.array([1.0, 0.5]), np.array([ANCHOR, 1]), np.array([25, 25])
    with pytest.raises(ValueError, match="already keep 0.5000 of the audio KV"):
        fit_lambda_mean([(s, roles, seg_len)], 0.3, 0)


# ----------------------------------------------------------------------------- capacity
def test_paper_capacity_is_prefill_plus_the_costliest_recallable_segments() -> None:
    ctx = make_ctx(2, 4, 2, 400, voice_score=VS4)  # 16 segments; chunks span 2 segments
    view = random_prefill(ctx)
    view.att[..., :100] *= 50.0  # a sink: global top-k leaves later segments costlier
    pol = make("wnw", 0.5, n_voice=3, n_anchor=1, lam=0.6, top_k=1, delta=2,
               prefill_selection="global")
    tiers = pol.prefill(ctx, view)
    tidal = pol.roles_ == TIDAL
    cost = ((tiers == Tier.CPU) & tidal[..., None]).sum(axis=(0, 1)).reshape(16, 25).sum(-1)
    assert len(set(cost.tolist())) > 1  # unequal costs: the order matters
    worst = np.sort(cost)[::-1][: 2 * 1 * 2].sum()  # δ · top_k · segments per chunk
    assert pol.gpu_capacity() == int((tiers == Tier.GPU).sum()) + worst


def test_lambda_solves_when_every_non_anchor_head_has_zero_importance() -> None:
    """Retention is s̃·λ = 0 whatever λ: the solves must still return a finite λ."""
    s, roles, seg_len = np.array([1.0, 0.0, 0.0]), np.array([ANCHOR, 1, 0]), np.array([25, 25])
    res = solve_lambda(s, roles, seg_len, 60, 0, 0)
    assert res.prefill_gpu == 50 and np.isfinite(res.lam)
    assert np.isfinite(fit_lambda_mean([(s, roles, seg_len)], 0.4, 0))


# ----------------------------------------------------------------------------- second mutmut run
def test_segment_layout_checks_its_arguments() -> None:
    """Segments are ceil(stride · tokens/s) tokens, at least one; the rate is positive and
    the stride in (0, chunk]."""
    with pytest.raises(ValueError, match="audio_tokens_per_s must be > 0, got 0"):
        SegmentLayout.from_seconds(100, 0.0, 4.0, 2.0)
    with pytest.raises(ValueError, match=r"need 0 < stride_seconds <= chunk_seconds, got 0.0, 4.0"):
        SegmentLayout.from_seconds(100, 12.5, 4.0, 0.0)
    slow = SegmentLayout.from_seconds(100, 0.5, 4.0, 2.0)  # one token per stride
    assert (slow.n_s, slow.n_c) == (1, 2)
    assert SegmentLayout.from_seconds(100, 12.5, 4.0, 0.5).n_s == 7  # a stride under a second
    assert SegmentLayout.from_seconds(100, 12.5, 4.0, 4.0).n_s == 50  # stride = chunk


def test_normalised_importance_divides_by_the_maximum() -> None:
    np.testing.assert_array_equal(normalised_importance(np.array([[2.0, 1.0], [0.5, 0.0]])),
                                  [[1.0, 0.5], [0.25, 0.0]])
    np.testing.assert_array_equal(normalised_importance(np.zeros((2, 3))), np.ones((2, 3)))
    assert normalised_importance(np.zeros((0,))).shape == (0,)


def test_quotas_and_roles_are_integer_arrays() -> None:
    from kvsim.policies._wnw_layout import kept_per_segment

    quota = kept_per_segment(np.array([0.5, 0.26]), np.array([25, 10]), 0)
    assert quota.dtype == np.int64 and quota.tolist() == [[12, 5], [6, 2]]
    assert triage(VS4, 3, 1).dtype == np.int8


def test_triage_breaks_ties_towards_the_lower_head_index() -> None:
    """Equal importance (common: heads a calibration never saw get 0) is ranked by (layer, head)
    index, on any machine: a stable sort, whatever NumPy's default sort does with ties."""
    importance = (np.arange(64) % 3 == 0).astype(float).reshape(8, 8)  # 22 ones, 42 zeros
    roles = triage(importance, n_voice=30, n_anchor=5).ravel()
    ones, zeros = np.flatnonzero(importance.ravel()), np.flatnonzero(importance.ravel() == 0)
    assert np.flatnonzero(roles == ANCHOR).tolist() == ones[:5].tolist()
    assert np.flatnonzero(roles != 0).tolist() == sorted([*ones, *zeros[:8]])


def test_tied_chunks_recall_the_earliest() -> None:
    """Chunk scores that tie exactly select the earliest chunks, on any machine (a stable
    sort). Every fourth segment draws the attention, so the 10 chunks touching one of them
    tie; the top 3 are chunks 0, 3 and 4 (segments 0, 1, 3, 4, 5)."""
    ctx = make_ctx(2, 4, 2, 500, voice_score=VS4)  # 20 segments of 25, 19 chunks
    pol = make("wnw", 0.6, n_voice=3, n_anchor=1, top_k=3, lam=0.5)
    pol.prefill(ctx, random_prefill(ctx))
    assert pol.last_scores_ is None  # nothing scored before the first step
    att = np.zeros((2, 4, 500))
    att[..., (np.arange(500) // 25) % 4 == 0] = 1.0
    tiers = pol.decode_step(FakeStepView(0, att))
    assert np.flatnonzero(pol.resident_segments_).tolist() == [0, 1, 3, 4, 5]
    tidal = pol.roles_ == TIDAL
    assert tiers is not None and (tiers[tidal][:, 75:150] == Tier.GPU).all()


def test_anchor_scores_accumulate_in_float64() -> None:
    """Eq. (2)'s sum over the anchor q-heads is taken in float64: a float32 sum of 1 and 1e-8
    would round to 1."""
    ctx = make_ctx(voice_score=VS4)
    pol = make("wnw", 0.6, n_voice=3, n_anchor=1)
    _quiet_prefill(pol, ctx)
    att = np.zeros((2, 4, 100))
    att[0, 0], att[0, 1] = 1.0, 1e-8  # the anchor is (layer 0, KV-head 0): q-heads 0 and 1
    view = FakeStepView(0, att)
    want = att[0, 0].astype(np.float32).astype(np.float64) + att[0, 1].astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(pol.anchor_scores(view), want)
    assert (pol.anchor_scores(view) > 1.0).all()


def test_step_attention_is_read_from_the_anchor_layers_only() -> None:
    """Eq. (2) sums the anchor heads' attention, so the driver computes step attention for
    their layers and no other."""
    two_layers = np.array([[1.0, 0.1], [0.9, 0.2]])  # anchors (0, 0) and (1, 0)
    for vs, n_anchor, layers in ((VS4, 1, [0]), (two_layers, 2, [0, 1])):
        ctx = make_ctx(voice_score=vs)
        pol = make("wnw", 0.6, n_voice=3, n_anchor=n_anchor)
        _quiet_prefill(pol, ctx)
        assert pol.step_attention_layers() == layers
