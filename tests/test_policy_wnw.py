"""WnW unit tests on hand-made views: eq. (1), the λ solve, eq. (2), triage, chunk swap."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies._wnw_layout import (
    ANCHOR,
    FIXED,
    TIDAL,
    SegmentLayout,
    count_prefill_gpu,
    default_voice_fraction,
    kept_per_segment,
    normalised_importance,
    solve_lambda,
    triage,
)
from kvsim.policies.base import MissingCalibrationError, Tier
from kvsim.policies.registry import make
from kvsim.policies.wnw import WnWBudgetWarning
from kvsim.policies.wnw_calibrate import fit_lambda, fit_lambda_table
from tests._zoo_a_views import FakeStepView, focused_step, make_ctx, random_prefill

VS4 = np.array([[1.0, 0.8], [0.5, 0.2]])  # importance ranking: (0,0) > (0,1) > (1,0) > (1,1)


def _wnw(budget: float = 1.0, **kw):
    kw.setdefault("n_voice", 3)
    kw.setdefault("n_anchor", 1)
    return make("wnw", budget, **kw)


# ----------------------------------------------------------------------------- geometry
@pytest.mark.parametrize(("r_tok", "n_s", "n_c"), [(12.5, 25, 50), (25.0, 50, 100), (6.0, 12, 24)])
def test_segment_and_chunk_sizes_follow_paper(r_tok: float, n_s: int, n_c: int) -> None:
    lay = SegmentLayout.from_seconds(1000, r_tok, 4.0, 2.0)
    assert (lay.n_s, lay.n_c) == (n_s, n_c)


def test_chunks_overlap_by_one_segment_and_cover_audio() -> None:
    lay = SegmentLayout.from_seconds(110, 12.5, 4.0, 2.0)  # segments of 25, last one 10
    assert lay.n_segments == 5 and lay.seg_len.tolist() == [25, 25, 25, 25, 10]
    assert [list(lay.chunk_segments(c)) for c in range(lay.n_chunks)] == [
        [0, 1], [1, 2], [2, 3], [3, 4]
    ]
    assert lay.chunk_bounds[-1, 1] == 110
    sc = lay.chunk_scores(np.arange(110, dtype=float))
    assert sc[0] == pytest.approx(np.arange(50).mean())
    assert sc[-1] == pytest.approx(np.arange(75, 110).mean())


# ----------------------------------------------------------------------------- triage
def test_triage_nested_ranking() -> None:
    roles = triage(VS4, n_voice=3, n_anchor=1)
    assert roles.tolist() == [[ANCHOR, TIDAL], [TIDAL, FIXED]]
    assert triage(VS4, 4, 2).tolist() == [[ANCHOR, ANCHOR], [TIDAL, TIDAL]]
    assert triage(VS4, 0, 5).tolist() == [[FIXED, FIXED], [FIXED, FIXED]]


@pytest.mark.parametrize(("signal", "anchor"), [("vs_hs", (1, 1)), ("vs", (0, 0)), ("hs", (1, 0))])
def test_triage_signal_ablation_a3(signal: str, anchor: tuple[int, int]) -> None:
    vs = np.array([[0.9, 0.1], [0.2, 0.8]])
    hs = np.array([[0.1, 0.1], [0.9, 0.7]])  # VS*HS: .09 .01 .18 .56
    ctx = make_ctx(voice_score=vs, sensitivity=hs)
    pol = _wnw(0.9, triage_signal=signal, n_voice=2)
    pol.prefill(ctx, random_prefill(ctx))
    assert pol.roles_[anchor] == ANCHOR
    assert (pol.roles_ == ANCHOR).sum() == 1 and (pol.roles_ == TIDAL).sum() == 1


def test_default_n_voice_fraction_matches_paper_table() -> None:
    assert default_voice_fraction(0.2) * 240 == pytest.approx(90)
    assert default_voice_fraction(0.4) * 240 == pytest.approx(50)
    assert default_voice_fraction(0.6) * 72 == pytest.approx(9)
    assert default_voice_fraction(0.1) == default_voice_fraction(0.2)
    assert default_voice_fraction(0.3) == pytest.approx((90 + 50) / 2 / 240)


# ----------------------------------------------------------------------------- eq. (1)
def test_eq1_retention_with_explicit_lambda() -> None:
    ctx = make_ctx(voice_score=VS4)
    pol = _wnw(1.0, lam=1.5)
    tiers = pol.prefill(ctx, random_prefill(ctx))
    s = normalised_importance(VS4)
    assert s.tolist() == [[1.0, 0.8], [0.5, 0.2]]
    np.testing.assert_allclose(pol.retention_, [[1.0, 1.0], [0.75, 0.3]])  # anchor -> 1
    gpu = (tiers == Tier.GPU).reshape(2, 2, 4, 25).sum(-1)  # per (head, segment)
    assert gpu[0, 0].tolist() == [25] * 4  # anchor: everything
    assert gpu[0, 1].tolist() == [25] * 4  # tidal, min(0.8*1.5, 1) = 1
    assert gpu[1, 0].tolist() == [18] * 4  # tidal, floor(0.75 * 25)
    assert gpu[1, 1].tolist() == [7] * 4  # fixed, floor(0.3 * 25)
    assert (tiers[1, 0] == Tier.CPU).sum() == 100 - 72  # tidal complement on CPU
    assert (tiers[1, 1] == Tier.GONE).sum() == 100 - 28  # fixed complement gone


def test_lambda_solve_is_the_largest_feasible_lambda() -> None:
    rng = np.random.default_rng(3)
    imp = rng.uniform(0.05, 1.0, size=(6, 4))
    s = normalised_importance(imp)
    roles = triage(imp, 10, 2)
    seg_len = SegmentLayout.from_seconds(300, 12.5, 4.0, 2.0).seg_len
    n_total = imp.size * 300
    for r in (0.15, 0.3, 0.55):
        budget = int(r * n_total)
        res = solve_lambda(s, roles, seg_len, budget, reserve_segments=0, min_per_segment=1)
        assert res.prefill_gpu == count_prefill_gpu(s, roles, seg_len, res.lam, 1)
        assert res.saturated is False
        assert res.prefill_gpu <= budget
        bigger = count_prefill_gpu(s, roles, seg_len, res.lam + 1e-6 / s[s > 0].min(), 1)
        assert bigger > budget  # maximal: any larger λ overshoots
        assert (budget - res.prefill_gpu) / n_total < 0.01  # hits the target


def test_lambda_solve_saturates_when_budget_allows_everything() -> None:
    imp = np.array([[1.0, 0.5], [0.25, 0.1]])
    seg_len = np.array([25, 25])
    res = solve_lambda(normalised_importance(imp), triage(imp, 2, 1), seg_len, 200, 6, 1)
    assert res.saturated and res.prefill_gpu == 200 and res.reserve == 0


def test_policy_solve_meets_budget_with_reserve() -> None:
    rng = np.random.default_rng(1)
    ctx = make_ctx(4, 8, 4, 400, voice_score=rng.uniform(0.1, 1, (4, 4)),
                   sensitivity=rng.uniform(0.1, 1, (4, 4)))
    for r in (0.2, 0.4, 0.6):
        pol = make("wnw", r, n_voice=8, n_anchor=2, budget_mode="step", min_per_segment=1)
        tiers = pol.prefill(ctx, random_prefill(ctx, seed=2))
        gpu = int((tiers == Tier.GPU).sum())
        B = ctx.budget_tokens(r)
        res = pol.solve_
        assert gpu == res.prefill_gpu <= B and pol.gpu_capacity() == B
        assert res.reserve == int(np.sort(pol._seg_cost)[::-1][:6].sum())
        if res.lam > 0:  # λ = 0 when even the one-per-segment floor leaves no full reserve
            assert gpu + res.reserve <= B
            assert (B - gpu - res.reserve) / ctx.audio_kv_total < 0.01
        ret = pol.retention_[pol.roles_ != ANCHOR]
        s = normalised_importance(ctx.head_scores.importance)[pol.roles_ != ANCHOR]
        np.testing.assert_allclose(ret, np.minimum(s * pol.lambda_solved_, 1.0))


def test_explicit_lambda_over_budget_is_a_clear_error() -> None:
    ctx = make_ctx(voice_score=VS4)
    with pytest.raises(ValueError, match="lam=10.0 keeps"):
        _wnw(0.3, lam=10.0, budget_mode="step").prefill(ctx, random_prefill(ctx))


def test_missing_head_scores_is_a_clear_error() -> None:
    ctx = make_ctx()
    with pytest.raises(MissingCalibrationError, match="policy 'wnw' needs per-head calibration"):
        _wnw(0.5).prefill(ctx, random_prefill(ctx))


# ----------------------------------------------------------------------------- prefill
def test_per_segment_selection_never_evicts_a_whole_segment() -> None:
    ctx = make_ctx(voice_score=VS4)
    view = random_prefill(ctx)
    view.att[..., :25] *= 50.0  # attention sink at the start of the audio
    kw = {"n_voice": 3, "n_anchor": 1, "lam": 0.5}
    seg = make("wnw", 0.35, **kw).prefill(ctx, view)
    glob = make("wnw", 0.35, **kw, prefill_selection="global").prefill(ctx, view)
    per_seg = (seg == Tier.GPU).reshape(2, 2, 4, 25).sum(-1)
    assert (per_seg >= 1).all()
    # global top-k spends the same total but empties later segments (A2 ablation)
    assert (glob == Tier.GPU).sum() == (seg == Tier.GPU).sum()
    assert ((glob == Tier.GPU).reshape(2, 2, 4, 25).sum(-1) == 0).any()


def test_prefill_picks_top_positions_within_each_segment() -> None:
    ctx = make_ctx(voice_score=VS4)
    view = random_prefill(ctx)
    tiers = _wnw(1.0, lam=1.5).prefill(ctx, view)
    p = view.att[1].sum(axis=1)[2:4].sum(axis=0)  # layer 1, kv-head 1 = q-heads 2,3 (fixed)
    for j in range(4):
        seg = p[j * 25 : (j + 1) * 25]
        kept = tiers[1, 1, j * 25 : (j + 1) * 25] == Tier.GPU
        assert kept.sum() == 7 and seg[kept].min() >= seg[~kept].max()


# ----------------------------------------------------------------------------- eq. (2)
def test_eq2_sums_anchor_q_heads_and_resets_every_step() -> None:
    vs = np.array([[0.1, 0.2], [1.0, 0.3]])  # anchor = layer 1, kv-head 0 -> q-heads 0, 1
    ctx = make_ctx(voice_score=vs)
    pol = make("wnw", 0.6, n_voice=2, n_anchor=1)
    pol.prefill(ctx, random_prefill(ctx))
    rng = np.random.default_rng(0)
    a1 = rng.uniform(size=(2, 4, 100))
    a2 = rng.uniform(size=(2, 4, 100))
    v1, v2 = FakeStepView(0, a1), FakeStepView(1, a2)
    np.testing.assert_allclose(pol.anchor_scores(v1), a1[1, 0] + a1[1, 1], rtol=1e-6)
    assert v1.read == [1]  # only anchor layers are read
    np.testing.assert_allclose(pol.anchor_scores(v2), a2[1, 0] + a2[1, 1], rtol=1e-6)
    pol.decode_step(v1)
    pol.decode_step(v2)
    np.testing.assert_allclose(pol.last_scores_, a2[1, 0] + a2[1, 1], rtol=1e-6)


# ----------------------------------------------------------------------------- chunk swap
def _swap_setup(budget: float = 0.6, **kw):
    ctx = make_ctx(2, 4, 2, 200, voice_score=VS4)  # 8 segments of 25, 7 chunks
    kw.setdefault("budget_mode", "step")
    kw.setdefault("min_per_segment", 1)
    pol = make("wnw", budget, n_voice=3, n_anchor=1, top_k=1, **kw)
    tiers0 = pol.prefill(ctx, random_prefill(ctx))
    return ctx, pol, tiers0


def test_recall_release_and_recall_again() -> None:
    ctx, pol, t0 = _swap_setup(reserve_segments=4)  # room for 2 selected + 2 lagging
    tidal = pol.roles_ == TIDAL
    assert tidal.sum() == 2 and (t0[tidal] == Tier.CPU).any()
    t1 = pol.decode_step(focused_step(ctx, 0, 150, 200))  # chunk 6 = segments 6, 7
    assert t1 is not None
    assert (t1[tidal][:, 150:200] == Tier.GPU).all()  # recalled in full
    assert (t1[tidal][:, :150] == t0[tidal][:, :150]).all()  # nothing else moved
    # unselected for delta - 1 steps: still resident (eviction lag)
    t = t1
    for s in range(1, pol.delta):
        out = pol.decode_step(focused_step(ctx, s, 0, 50))  # chunk 0 = segments 0, 1
        t = out if out is not None else t
        assert (t[tidal][:, 150:200] == Tier.GPU).all()
    t = pol.decode_step(focused_step(ctx, pol.delta, 0, 50))
    assert t is not None
    assert (t[tidal][:, 150:200] == t0[tidal][:, 150:200]).all()  # back to prefill subset
    assert (t[tidal][:, 0:50] == Tier.GPU).all()
    t = pol.decode_step(focused_step(ctx, pol.delta + 1, 150, 200))  # regains importance
    assert t is not None and (t[tidal][:, 150:200] == Tier.GPU).all()


def test_fixed_heads_never_recall_and_anchors_keep_everything() -> None:
    ctx, pol, t0 = _swap_setup(0.5)
    fixed, anchor = pol.roles_ == FIXED, pol.roles_ == ANCHOR
    assert fixed.any() and anchor.any()
    cap = pol.gpu_capacity()
    rng = np.random.default_rng(5)
    tiers = t0
    for s in range(30):
        lo = int(rng.integers(0, 190))
        out = pol.decode_step(focused_step(ctx, s, lo, lo + 10))
        if out is not None:
            assert ((out == Tier.GPU) <= (tiers >= Tier.CPU)).all()  # GPU only from GPU/CPU
            tiers = out
        assert (tiers[fixed] == t0[fixed]).all()
        assert (tiers[anchor] == Tier.GPU).all()
        assert int((tiers == Tier.GPU).sum()) <= cap


def test_budget_cap_holds_when_many_segments_are_wanted() -> None:
    ctx = make_ctx(2, 4, 2, 400, voice_score=VS4)
    pol = make("wnw", 0.45, n_voice=3, n_anchor=1, top_k=3, reserve_segments=1,
               budget_mode="step", min_per_segment=1)
    tiers = pol.prefill(ctx, random_prefill(ctx))
    B = pol.gpu_capacity()
    counts = [int((tiers == Tier.GPU).sum())]
    for s in range(40):
        lo = (s * 37) % 350
        att = np.zeros((2, 4, 400))
        att[..., lo : lo + 50] = 1.0
        att[..., (lo + 200) % 350 : (lo + 200) % 350 + 50] = 1.0  # two separate hot spots
        out = pol.decode_step(FakeStepView(s, att))
        tiers = out if out is not None else tiers
        counts.append(int((tiers == Tier.GPU).sum()))
    assert max(counts) <= B
    assert len(set(counts)) > 1  # recall/release makes the footprint oscillate


def test_small_model_clips_anchors_to_fit_budget() -> None:
    ctx = make_ctx(1, 2, 2, 100, voice_score=np.array([[1.0, 0.5]]))
    pol = make("wnw", 0.3, n_voice=2, n_anchor=5, budget_mode="step")
    with pytest.warns(WnWBudgetWarning, match="running with 0 anchors"):
        tiers = pol.prefill(ctx, random_prefill(ctx))
    assert (pol.roles_ == ANCHOR).sum() == 0  # one anchor alone would need 0.5 > 0.3
    assert int((tiers == Tier.GPU).sum()) <= ctx.budget_tokens(0.3)
    assert pol.decode_step(focused_step(ctx, 0, 0, 10)) is None  # no observer, no recall


def test_cap_pressure_releases_lagging_segments_before_refusing_a_recall() -> None:
    ctx, pol, t0 = _swap_setup(reserve_segments=2)
    tidal = pol.roles_ == TIDAL
    pol.decode_step(focused_step(ctx, 0, 150, 200))  # segments 6, 7 resident
    assert pol.resident_segments_.tolist() == [False] * 6 + [True, True]
    t = pol.decode_step(focused_step(ctx, 1, 0, 50))  # wants 0, 1; only 2 segments fit
    assert pol.resident_segments_.tolist() == [True, True] + [False] * 6
    assert (t[tidal][:, 150:200] == t0[tidal][:, 150:200]).all()
    assert int((t == Tier.GPU).sum()) <= pol.gpu_capacity()


@pytest.mark.parametrize(
    ("params", "msg"),
    [
        ({"n_voice": "30"}, "wnw: n_voice must be an integer"),
        ({"n_voice": -1}, "wnw: n_voice must be >= 0, got -1"),
        ({"top_k": 1.5}, "wnw: top_k must be an integer"),
        ({"lam": "big"}, "wnw: lam must be a number"),
        ({"stride_seconds": 5.0}, r"wnw: stride_seconds must be in \(0, 4\], got 5.0"),
        ({"stride_seconds": 0.0}, r"wnw: stride_seconds must be in \(0, 4\], got 0.0"),
        ({"triage_signal": "xx"}, "wnw: triage_signal must be one of"),
        ({"prefill_selection": "top"}, "wnw: prefill_selection must be one of"),
        ({"delta": 0}, "wnw: delta must be >= 1, got 0"),
        ({"top_k": 0}, "wnw: top_k must be >= 1, got 0"),
        ({"n_anchor": -1}, "wnw: n_anchor must be >= 0, got -1"),
        ({"lam": -0.5}, "wnw: lam must be >= 0, got -0.5"),
        ({"min_per_segment": -1}, "wnw: min_per_segment must be >= 0"),
        ({"budget_mode": "prefill"}, "wnw: budget_mode must be one of"),
        ({"chunk_seconds": 0.0}, "wnw: chunk_seconds must be > 0"),
        ({"reserve_segments": -1}, "wnw: reserve_segments must be >= 0, got -1"),
    ],
)
def test_bad_hyperparameters_give_one_line_errors(params: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        make("wnw", 0.2, **params)


def test_range_edges_are_accepted() -> None:
    for params in ({"reserve_segments": 0}, {"n_voice": 0}, {"n_anchor": 0}, {"lam": 0.0},
                   {"min_per_segment": 0}, {"stride_seconds": 4.0}):
        make("wnw", 0.2, **params)


# ----------------------------------------------------------------------------- §3.4 accounting
def test_paper_accounting_is_the_default_and_recalls_come_on_top() -> None:
    """§3.4: λ makes the *prefill* retention meet the target; recalls add to it."""
    ctx = make_ctx(2, 4, 2, 400, voice_score=VS4)
    pol = make("wnw", 0.45, n_voice=3, n_anchor=1)
    assert pol.budget_mode == "paper" and pol.min_per_segment == 0 and pol.lam is None
    with pytest.warns(WnWBudgetWarning, match="per-input λ, not the paper's"):
        t0 = pol.prefill(ctx, random_prefill(ctx))
    B = ctx.budget_tokens(0.45)
    gpu0 = int((t0 == Tier.GPU).sum())
    assert pol.lam_source_ == "input" and pol.solve_ is None
    assert gpu0 == count_prefill_gpu(normalised_importance(VS4), pol.roles_,
                                     pol._layout.seg_len, pol.lambda_solved_, 0) <= B
    s = normalised_importance(VS4)[pol.roles_ != ANCHOR]
    bigger = pol.lambda_solved_ + 1e-6 / s.min()
    assert count_prefill_gpu(normalised_importance(VS4), pol.roles_, pol._layout.seg_len,
                             bigger, 0) > B  # the largest λ that fits: prefill r = target
    assert pol.gpu_capacity() > B
    tiers, counts = t0, []
    for step in range(12):
        lo = (step * 30) % 350
        out = pol.decode_step(focused_step(ctx, step, lo, lo + 50))
        tiers = out if out is not None else tiers
        counts.append(int((tiers == Tier.GPU).sum()))
    assert max(counts) > B  # recalls come on top of the budget...
    assert max(counts) <= pol.gpu_capacity()  # ...within the true worst-case bound


def test_explicit_lam_is_used_as_given_without_a_warning(recwarn) -> None:
    ctx = make_ctx(2, 4, 2, 400, voice_score=VS4)
    pol = make("wnw", 0.3, n_voice=3, n_anchor=1, lam=0.9)
    tiers = pol.prefill(ctx, random_prefill(ctx))
    assert not [w for w in recwarn if issubclass(w.category, WnWBudgetWarning)]
    assert pol.lambda_solved_ == 0.9 and pol.lam_source_ == "given"
    # paper mode does not check a given λ against this input's B: prefill r may differ
    assert int((tiers == Tier.GPU).sum()) == count_prefill_gpu(
        normalised_importance(VS4), pol.roles_, pol._layout.seg_len, 0.9, 0)


def test_fit_lambda_on_a_calibration_set_meets_the_mean_target() -> None:
    rng = np.random.default_rng(7)
    ctxs = [make_ctx(3, 6, 3, n, voice_score=rng.uniform(0.1, 1, (3, 3)))
            for n in (150, 260, 420)]
    for r in (0.3, 0.5):
        lam = fit_lambda(ctxs, r, n_voice=5, n_anchor=1)

        def mean_prefill(lam_: float, r: float = r) -> float:
            fr = []
            for c in ctxs:
                p = make("wnw", r, n_voice=5, n_anchor=1, lam=lam_)
                t = p.prefill(c, random_prefill(c))
                fr.append((t == Tier.GPU).sum() / c.audio_kv_total)
            return float(np.mean(fr))

        assert mean_prefill(lam) <= r + 1e-12
        assert r - mean_prefill(lam) < 0.02  # close to the target from below
        assert mean_prefill(lam * (1 + 1e-4) + 1e-6) > r  # the largest λ that fits
    one = fit_lambda(ctxs[:1], 0.3, n_voice=5, n_anchor=1)
    pol = make("wnw", 0.3, n_voice=5, n_anchor=1)
    with pytest.warns(WnWBudgetWarning):
        pol.prefill(ctxs[0], random_prefill(ctxs[0]))
    assert pol.lambda_solved_ == one  # the per-input fallback is the same fit on one input
    assert set(fit_lambda_table(ctxs, [0.3, 0.5], n_voice=5, n_anchor=1)) == {0.3, 0.5}


def test_infeasible_anchors_are_reduced_with_a_warning_never_silently() -> None:
    ctx = make_ctx(1, 2, 2, 100, voice_score=np.array([[1.0, 0.5]]))
    for mode in ("paper", "step"):
        pol = make("wnw", 0.3, n_voice=2, n_anchor=1, budget_mode=mode)  # 1 anchor = 0.5 > 0.3
        with pytest.warns(WnWBudgetWarning, match="1 anchors .* running with 0 anchors"):
            tiers = pol.prefill(ctx, random_prefill(ctx))
        assert (pol.roles_ == ANCHOR).sum() == 0
        assert int((tiers == Tier.GPU).sum()) <= ctx.budget_tokens(0.3)
    with pytest.raises(ValueError, match=r"wnw: at λ = 0 the anchors .* over the target r=0.3"):
        fit_lambda([ctx], 0.3, n_voice=2, n_anchor=1)  # a calibration does not clip


def test_step_mode_warns_when_no_recall_can_ever_fit() -> None:
    ctx = make_ctx(2, 4, 2, 200, voice_score=VS4)
    pol = make("wnw", 0.27, n_voice=3, n_anchor=1, budget_mode="step", min_per_segment=1)
    with pytest.warns(WnWBudgetWarning, match="never recall"):
        pol.prefill(ctx, random_prefill(ctx))


def test_quota_is_floor_of_retention_times_segment_and_may_be_zero() -> None:
    """§2.3: "the top ⌊retention_{l,k} · n_s⌋ positions are kept" (0 allowed)."""
    ret = np.array([0.0, 0.03, 0.04, 0.5, 1.0])
    seg_len = np.array([25, 25, 10])
    assert kept_per_segment(ret, seg_len, 0).tolist() == [
        [0, 0, 0], [0, 0, 0], [1, 1, 0], [12, 12, 5], [25, 25, 10]]
    assert kept_per_segment(ret, seg_len, 1).tolist() == [
        [1, 1, 1], [1, 1, 1], [1, 1, 1], [12, 12, 5], [25, 25, 10]]
    ctx = make_ctx(voice_score=VS4)
    paper = make("wnw", 1.0, n_voice=3, n_anchor=1, lam=0.1)  # fixed head: ⌊0.02·25⌋ = 0
    floor1 = make("wnw", 1.0, n_voice=3, n_anchor=1, lam=0.1, min_per_segment=1)
    view = random_prefill(ctx)
    assert (paper.prefill(ctx, view)[1, 1] == Tier.GPU).sum() == 0
    assert ((floor1.prefill(ctx, view)[1, 1] == Tier.GPU).reshape(4, 25).sum(-1) == 1).all()


def test_audio_within_top_k_chunks_warns_that_every_step_recalls_all_of_it(recwarn) -> None:
    """5 s of audio (W_c 4 s, W_s 2 s: 2 chunks) under top_k = 3: every chunk is selected at
    every step, so paper-mode recalls bring every tidal segment back and r_GPU approaches
    r_GPU+CPU whatever the target. The warning says so; 32 s of audio (15 chunks) does not."""
    ctx = make_ctx(2, 4, 2, 62, voice_score=VS4)  # 62 tokens at 12.5/s: 2 chunks
    with pytest.warns(WnWBudgetWarning, match=r"all 2 chunks .* top_k=3"):
        make("wnw", 0.3, n_voice=3, n_anchor=1, lam=0.9).prefill(ctx, random_prefill(ctx))
    ctx = make_ctx(2, 4, 2, 100, voice_score=VS4)  # 8 s: exactly 3 chunks, still all selected
    with pytest.warns(WnWBudgetWarning, match=r"all 3 chunks"):
        make("wnw", 0.3, n_voice=3, n_anchor=1, lam=0.9).prefill(ctx, random_prefill(ctx))
    recwarn.clear()
    for n_audio in (101, 400):  # 4 and 15 chunks: the top 3 leave some out
        ctx = make_ctx(2, 4, 2, n_audio, voice_score=VS4)
        make("wnw", 0.3, n_voice=3, n_anchor=1, lam=0.9).prefill(ctx, random_prefill(ctx))
    assert not [w for w in recwarn if "chunks" in str(w.message)]
