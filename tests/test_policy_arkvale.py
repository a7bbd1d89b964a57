"""ArkVale: bounding-box digests, page budget at every step, recall from a full CPU mirror."""

from __future__ import annotations

import numpy as np
import pytest
from float32_bounds import dot_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo_fakes import FakePrefill, FakeQuery, drive, make_ctx, random_prefill

from kvsim.policies import PolicyNotApplicable, Tier, make
from kvsim.policies._pages import bounding_box_digest, box_upper_bound, page_of_position


def test_digest_hand_case() -> None:
    # one channel, page of 3 keys 0, 2, 4 -> c = 2, d = mean(2, 0, 2) = 4/3
    keys = np.array([[[0.0], [2.0], [4.0], [10.0]]], dtype=np.float32)
    lo, hi = bounding_box_digest(keys, 3)
    assert lo[0, 0, 0] == pytest.approx(2 - 4 / 3) and hi[0, 0, 0] == pytest.approx(2 + 4 / 3)
    assert lo[0, 1, 0] == hi[0, 1, 0] == 10.0  # a one-key page has radius 0


@settings(max_examples=80, deadline=None)
@given(t_a=st.integers(1, 80), d=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_bound_dominates_every_point_of_the_box(t_a: int, d: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(1, t_a, d)).astype(np.float32) * 3
    q = rng.normal(size=(2, d)).astype(np.float32)
    lo, hi = bounding_box_digest(keys, 32)
    assert (lo <= hi).all()
    bound = box_upper_bound(q, lo, hi)[0]  # (g=2, P)
    u = rng.random(size=(200, *lo.shape[1:]))
    pts = lo[0][None] + u * (hi[0] - lo[0])[None]  # (200, P, d) points inside every box
    dots = np.einsum("gd,npd->gnp", q.astype(np.float64), pts)
    # float32 q·m + |q|·w (m, w the rounded box centre and half-width): γ_{D+2}·Σ|q_i|·max|box|
    # off the exact corner value (dot_bound adds the float64 reference's error and underflow)
    tol = dot_bound(d + 2, np.abs(q).sum(axis=-1).max() * max(np.abs(lo).max(), np.abs(hi).max()))
    assert (bound[:, None, :] >= dots - tol).all()
    corners = np.where(q[:, None, :] > 0, hi[0][None], lo[0][None])  # the maximising corner
    assert np.allclose(bound, np.einsum("gd,gpd->gp", q.astype(np.float64), corners), rtol=0, atol=tol)


@pytest.mark.parametrize(("h_kv", "t_a", "d", "page", "seed"),
                         [(1, 1, 1, 32, 0), (3, 100, 5, 32, 1), (8, 1000, 16, 32, 2), (4, 77, 8, 7, 3)])
def test_digest_one_head_at_a_time_is_the_whole_layers(h_kv: int, t_a: int, d: int, page: int,
                                                       seed: int) -> None:
    """The digest computed a KV-head at a time (float64 temporaries of one head) equals the
    whole-layer formula bit for bit, also on a view of a wider key array (the audio span)."""
    rng = np.random.default_rng(seed)
    wide = (rng.normal(size=(h_kv, t_a + 9, d)) * 4).astype(np.float32)
    for keys in (np.ascontiguousarray(wide[:, :t_a]), wide[:, 5 : 5 + t_a]):
        starts = np.arange(0, t_a, page)
        lo = np.minimum.reduceat(keys, starts, axis=1).astype(np.float64)
        hi = np.maximum.reduceat(keys, starts, axis=1).astype(np.float64)
        centre = (hi + lo) / 2.0
        dev = np.abs(keys.astype(np.float64) - centre[:, page_of_position(t_a, page), :])
        sizes = np.minimum(starts + page, t_a) - starts
        radius = np.add.reduceat(dev, starts, axis=1) / sizes[None, :, None]
        got = bounding_box_digest(keys, page)
        for a, b in zip(got, ((centre - radius).astype(np.float32),
                              (centre + radius).astype(np.float32)), strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_box_is_within_minmax_box() -> None:
    keys = np.random.default_rng(1).normal(size=(2, 100, 5)).astype(np.float32)
    lo, hi = bounding_box_digest(keys, 32)
    starts = np.arange(0, 100, 32)
    assert (lo >= np.minimum.reduceat(keys, starts, axis=1) - 1e-6).all()
    assert (hi <= np.maximum.reduceat(keys, starts, axis=1) + 1e-6).all()


@pytest.mark.parametrize("unit", ["tokens", "pages"])
@pytest.mark.parametrize("r", [0.2, 0.4, 0.6, 0.8])
def test_page_budget_every_step_full_mirror(r: float, unit: str) -> None:
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=500)  # 16 pages, last 20 tok
    pol = make("arkvale", r, budget_unit=unit)
    log = drive(pol, ctx, random_prefill(ctx), n_steps=8)
    tokens = int(np.floor(r * 500))
    # tokens: sink (32) + window (20) + as many full pages as fit in the rest
    budget = int(np.floor(r * 16)) if unit == "pages" else 2 + (tokens - 52) // 32
    assert pol.page_budget == budget
    page = page_of_position(500, 32)
    for tiers in log.tiers:
        assert set(np.unique(tiers)) <= {Tier.GPU, Tier.CPU}  # r_GPU+CPU = 1
        gpu = tiers == Tier.GPU
        per_page = np.zeros((*gpu.shape[:2], 16), dtype=int)
        np.add.at(per_page, (slice(None), slice(None), page), gpu.astype(int))
        sizes = np.bincount(page)
        assert ((per_page == 0) | (per_page == sizes)).all()  # whole pages move
        assert ((per_page > 0).sum(axis=-1) == budget).all()
        assert gpu[..., :32].all() and gpu[..., 480:].all()  # sink and window pages
        assert gpu.sum() <= pol.gpu_capacity()
        if unit == "tokens":
            assert (gpu.sum(axis=-1) <= tokens).all()  # never above the token budget
    measured = np.mean([(t == Tier.GPU).mean() for t in log.tiers[1:]])
    if unit == "tokens":
        assert r - 32 / 500 < measured <= r  # within one page below the target
    else:
        assert abs(measured - r) < 1 / 16 + 0.05


def test_recalls_cpu_page_that_becomes_top() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=4, n_audio=320)  # 10 pages
    keys = np.random.default_rng(0).normal(size=(1, 1, 320, 4)).astype(np.float32) * 0.1
    keys[0, 0, 200] = [6.0, 0.0, 0.0, 0.0]  # page 6
    att = np.zeros((1, 2, 1, 320), dtype=np.float32)
    att[0, :, 0, 100] = 0.9  # prefill prefers page 3
    pol = make("arkvale", 0.3, topk_fraction=1.0)  # P = 3: sink 0, window 9, one free page
    tiers = pol.prefill(ctx, FakePrefill(att, keys))
    assert sorted(set((np.flatnonzero(tiers[0, 0] == Tier.GPU) // 32).tolist())) == [0, 3, 9]
    q = np.array([[1.0, 0, 0, 0], [1.0, 0, 0, 0]], dtype=np.float32)
    read = pol.select(FakeQuery(0, 0, q, keys[0]))
    now = pol.current_tiers()
    assert sorted(set((np.flatnonzero(now[0, 0] == Tier.GPU) // 32).tolist())) == [0, 6, 9]
    assert (now[0, 0, 96:128] == Tier.CPU).all()  # page 3 went back to CPU, not GONE
    assert (read[0] == (now[0, 0] == Tier.GPU)).all()


def test_default_topk_keeps_previous_residents_when_room() -> None:
    """With top-k = half the budget, a resident page outside the top-k stays (no churn)."""
    ctx = make_ctx(n_layers=1, n_q_heads=1, n_kv_heads=1, head_dim=2, n_audio=320)
    keys = np.zeros((1, 1, 320, 2), dtype=np.float32)
    for p in range(10):
        keys[0, 0, p * 32 : (p + 1) * 32, 0] = p  # page p scores p * q0
    att = np.zeros((1, 1, 1, 320), dtype=np.float32)
    att[0, 0, 0, [40, 70, 110, 140]] = 1.0  # prefill keeps pages 1, 2, 3, 4 (P = 6 incl 0, 9)
    pol = make("arkvale", 0.6)  # P = 6, forced 2, k = 3 - 2 = 1
    pol.prefill(ctx, FakePrefill(att, keys))
    assert pol.page_budget == 6 and pol.topk == 1
    pol.select(FakeQuery(0, 0, np.array([[1.0, 0.0]], dtype=np.float32), keys[0]))
    pages = sorted(set((np.flatnonzero(pol.current_tiers()[0, 0] == Tier.GPU) // 32).tolist()))
    # top-1 free page is 8: recalled, replacing the lowest resident (page 1); 2, 3, 4 stay
    assert pages == [0, 2, 3, 4, 8, 9]


def test_sparse_read_reads_only_sink_topk_window() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=4, n_audio=640)  # 20 pages
    view = random_prefill(ctx)
    pol = make("arkvale", 0.5, sparse_read=True)  # P = 10, k = 5 - 2 = 3
    pol.prefill(ctx, view)
    read = pol.select(FakeQuery(0, 0, np.ones((2, 4), dtype=np.float32), view.keys[0]))
    assert read.sum() == (2 + 3) * 32
    assert (pol.current_tiers()[0][read] == Tier.GPU).all()


def test_tiny_budget() -> None:
    ctx = make_ctx(n_audio=40)  # 2 pages (32 + 8 tokens), r = 0.2 -> 8 tokens, 0.4 pages
    pol = make("arkvale", 0.2)  # the 8-token window page fits the 8-token budget
    log = drive(pol, ctx, random_prefill(ctx), n_steps=2)
    for t in log.tiers:
        assert (t[..., 32:] == Tier.GPU).all() and (t[..., :32] == Tier.CPU).all()
    assert pol.page_budget == 1 and pol.gpu_capacity() == 8 * 4


@pytest.mark.parametrize(("n_audio", "unit", "said"), [
    (40, "pages", "floor(0.2 × 2 pages) = 0"),  # 0.4 of a page
    (125, "tokens", "25 tokens"),  # 4 pages of 32 (the last 29 tokens): none fits in 25
])
def test_a_budget_that_holds_no_page_is_refused_not_run_empty(n_audio: int, unit: str,
                                                             said: str) -> None:
    """A page budget of 0 would keep no audio at all: r_GPU 0 and recall 0 averaged into a
    table as if ArkVale had run. The policy refuses the input instead (replay reports it and
    the other policies go on)."""
    ctx = make_ctx(n_audio=n_audio)
    pol = make("arkvale", 0.2, budget_unit=unit)
    with pytest.raises(PolicyNotApplicable, match="arkvale") as info:
        pol.prefill(ctx, random_prefill(ctx))
    assert said in str(info.value) and "page_size" in str(info.value)


def test_share_heads_keeps_one_page_set_per_layer() -> None:
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, n_audio=640)
    view = random_prefill(ctx)
    shared = make("arkvale", 0.4, share_heads=True)
    log = drive(shared, ctx, view, n_steps=6)
    for t in log.tiers:
        assert (t[:, 0] == t[:, 1]).all()
    per_head = drive(make("arkvale", 0.4), ctx, view, n_steps=6)
    assert any((t[:, 0] != t[:, 1]).any() for t in per_head.tiers)  # heads differ otherwise


def test_engine_recalls_whole_pages_from_the_mirror() -> None:
    """Through the real engine on a trace whose decode attention sweeps the audio: pages are
    recalled whole (h2d tokens a multiple of 32, at most one copy per page), every step keeps
    the page budget, and nothing is ever discarded (r_GPU+CPU = 1)."""
    import tempfile
    from pathlib import Path

    from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
    from kvsim.synth import SynthConfig, synthesize
    from kvsim.trace.reader import Trace
    from kvsim.trace.writer import write_trace

    data = synthesize(SynthConfig(preset="small", audio_seconds=40.96, decode_steps=20, seed=4))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        assert trace.n_audio == 512  # 16 whole pages
        (run,) = replay_trace(trace, [PolicySpec("arkvale", 0.4)], ReplayConfig(record_tiers=True))
    log = run.step_log
    h2d = log["h2d_tokens"].to_numpy()
    assert h2d.sum() > 0 and (h2d % 32 == 0).all()
    assert (log["h2d_transfers"].to_numpy() <= h2d // 32).all()
    assert (log["h2d_bytes"].to_numpy() == h2d * run.facts.kv_bytes_per_head_token).all()
    assert run.summary["r_gpu_cpu"] == 1.0
    page = page_of_position(512, 32)
    budget = 2 + (int(0.4 * 512) - 64) // 32  # sink + window + full pages that fit
    for t in run.tiers:
        per_page = np.zeros((*t.shape[:2], 16), dtype=int)
        np.add.at(per_page, (slice(None), slice(None), page), (t == Tier.GPU).astype(int))
        assert ((per_page > 0).sum(axis=-1) == budget).all()
