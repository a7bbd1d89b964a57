"""Quest: min/max page bound, per-step per-layer top-K pages, everything stays resident."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from float32_bounds import dot_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo_fakes import FakeQuery, drive, make_ctx, random_prefill

from kvsim.policies import Tier, make
from kvsim.policies._pages import box_upper_bound, minmax_digest, n_pages, page_sizes

_finite = st.floats(-8, 8, allow_nan=False, width=32)


@settings(max_examples=80, deadline=None)
@given(
    t_a=st.integers(1, 70),
    d=st.integers(1, 6),
    g=st.sampled_from([1, 2, 3]),
    page=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_bound_dominates_true_max_over_page(t_a: int, d: int, g: int, page: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = (rng.normal(size=(2, t_a, d)) * rng.uniform(0.1, 5)).astype(np.float32)
    q = rng.normal(size=(2 * g, d)).astype(np.float32)
    lo, hi = minmax_digest(keys, page)
    bound = box_upper_bound(q, lo, hi)  # (H_kv, g, P)
    true = np.einsum("kgd,ktd->kgt", q.reshape(2, g, d).astype(np.float64), keys.astype(np.float64))
    # float32 arithmetic: tolerance relative to the size of the products summed
    # (float32 q·m + |q|·w, m and w the rounded box centre and half-width: γ_{D+2}, and the
    # float64 reference's error and underflow: dot_bound)
    tol = dot_bound(d + 2, np.abs(q).sum(axis=-1).max() * np.abs(keys).max())
    for p, start in enumerate(range(0, t_a, page)):
        page_max = true[:, :, start : start + page].max(axis=-1)
        assert (bound[:, :, p] >= page_max - tol).all()


@given(q=st.lists(_finite, min_size=3, max_size=3), a=st.lists(_finite, min_size=6, max_size=6))
def test_bound_is_max_over_box_corners(q: list[float], a: list[float]) -> None:
    """sum_i max(q_i hi_i, q_i lo_i) is attained at a corner of the box (it is tight)."""
    lo = np.minimum(a[:3], a[3:])[None, None, :].astype(np.float32)
    hi = np.maximum(a[:3], a[3:])[None, None, :].astype(np.float32)
    qa = np.array([q], dtype=np.float32)
    bound = box_upper_bound(qa, lo, hi)[0, 0, 0]
    corners = [np.where(bits, hi[0, 0], lo[0, 0]) for bits in itertools.product([0, 1], repeat=3)]
    best = max(float(np.dot(qa[0].astype(np.float64), c.astype(np.float64))) for c in corners)
    scale = float(np.abs(qa).sum() * max(np.abs(lo).max(), np.abs(hi).max()))
    assert bound == pytest.approx(best, rel=0, abs=dot_bound(5, scale))  # as above, D=3


def test_minmax_digest_hand_case() -> None:
    keys = np.array([[[1.0, -2.0], [3.0, 0.0], [-1.0, 5.0]]], dtype=np.float32)  # T_a=3, page 2
    lo, hi = minmax_digest(keys, 2)
    assert lo.tolist() == [[[1.0, -2.0], [-1.0, 5.0]]]
    assert hi.tolist() == [[[3.0, 0.0], [-1.0, 5.0]]]
    assert page_sizes(3, 2).tolist() == [2, 1] and n_pages(3, 2) == 2


def test_select_picks_page_aligned_with_query() -> None:
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=4, n_audio=64)
    keys = np.random.default_rng(0).normal(size=(1, 64, 4)).astype(np.float32) * 0.1
    keys[0, 37] = [10.0, 0.0, 0.0, 0.0]  # page 2 (32..47) holds one key aligned with q
    pol = make("quest", 0.25)  # 4 pages -> K = 1
    tiers = pol.prefill(ctx, random_prefill(ctx))
    assert (tiers == Tier.GPU).all()
    q = np.array([[1.0, 0, 0, 0], [0.5, 0, 0, 0]], dtype=np.float32)
    mask = pol.select(FakeQuery(0, 0, q, keys))
    assert np.flatnonzero(mask[0]).tolist() == list(range(32, 48))


@pytest.mark.parametrize("r", [0.2, 0.5, 0.8])
def test_reads_at_most_page_budget_and_keeps_all_resident(r: float) -> None:
    ctx = make_ctx(n_audio=150)  # 10 pages, the last one partial (6 tokens)
    pol = make("quest", r)
    log = drive(pol, ctx, random_prefill(ctx), n_steps=5)
    budget = int(np.floor(r * 10))
    assert pol.page_budget == budget
    for tiers in log.tiers:
        assert (tiers == Tier.GPU).all()  # saves bandwidth, not capacity
    for reads in log.reads:
        pages = reads.reshape(*reads.shape[:2], -1)[..., :144].reshape(*reads.shape[:2], 9, 16)
        whole = pages.all(axis=-1) | ~pages.any(axis=-1)
        assert whole.all()  # page-aligned reads
        n_read_pages = pages.any(axis=-1).sum(axis=-1) + reads[..., 144:].any(axis=-1)
        assert (n_read_pages == budget).all()
    frac = np.mean([reads.mean() for reads in log.reads])
    assert abs(frac - r) < 0.1
    assert pol.saves_capacity is False and pol.query_aware


def test_dense_layers_read_everything() -> None:
    ctx = make_ctx(n_layers=3, n_audio=64)
    pol = make("quest", 0.25, dense_layers=2)
    view = random_prefill(ctx)
    pol.prefill(ctx, view)
    q = np.ones((4, 8), dtype=np.float32)
    assert pol.select(FakeQuery(0, 1, q, view.keys[1])) is None
    assert pol.select(FakeQuery(0, 2, q, view.keys[2])).sum() == 2 * 16


def test_bad_group_reduce() -> None:
    with pytest.raises(ValueError, match="group_reduce"):
        make("quest", 0.5, group_reduce="median")


@pytest.mark.parametrize("r", [0.25, 0.5])
def test_engine_reads_page_budget_and_keeps_capacity(r: float) -> None:
    """Through the real engine: r_GPU stays 1 while the step log's read_audio_tokens is exactly
    K pages of 16 per (layer, KV-head) at every step (T_a = 128 = 8 whole pages)."""
    import tempfile
    from pathlib import Path

    from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
    from kvsim.synth import SynthConfig, synthesize
    from kvsim.trace.reader import Trace
    from kvsim.trace.writer import write_trace

    data = synthesize(SynthConfig(preset="tiny", audio_seconds=10.24, decode_steps=6, seed=5))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        assert trace.n_audio == 128
        (run,) = replay_trace(trace, [PolicySpec("quest", r)], ReplayConfig())
    heads = trace.head_layout
    k_pages = int(r * 8)
    reads = run.step_log["read_audio_tokens"].to_numpy()
    assert (reads == heads.n_layers * heads.n_kv_heads * k_pages * 16).all()
    assert run.summary["r_gpu"] == run.summary["r_gpu_cpu"] == 1.0
    assert run.summary["read_fraction"] == pytest.approx(r)
    assert run.summary["h2d_mb_per_step"] == 0.0


def test_a_budget_that_reads_no_page_is_refused_not_run_empty() -> None:
    """floor(r · n_pages) = 0 would read no audio at all (recall 0 at r_GPU 1); the policy
    refuses the input instead, naming the count and what to change."""
    from kvsim.policies import PolicyNotApplicable

    ctx = make_ctx(n_audio=100)  # page_size=128: one page; floor(0.4 · 1) = 0
    with pytest.raises(PolicyNotApplicable, match=r"quest: .*floor\(0.4 × 1 pages\) = 0") as info:
        make("quest", 0.4, page_size=128).prefill(ctx, random_prefill(ctx))
    assert "page_size" in str(info.value)
    pol = make("quest", 0.4, page_size=50)  # two pages: floor(0.8) = 0 too
    with pytest.raises(PolicyNotApplicable):
        pol.prefill(ctx, random_prefill(ctx))
    pol = make("quest", 0.5, page_size=50)  # one page read
    pol.prefill(ctx, random_prefill(ctx))
    assert pol.page_budget == 1
