"""VoxZip stage 2 unit tests: the decay recurrence, prefill seeding, sink/recent/top-N split."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.policies.base import Tier
from kvsim.policies.registry import make
from kvsim.policies.voxzip import (
    cache_retention,
    decayed_accumulate,
    generation_scope_keep,
    sink_recent_topn,
)
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace
from tests._zoo_a_views import FakePrefillView, FakeStepView, make_ctx, random_prefill


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


@pytest.mark.parametrize("scope", ["audio", "generation"])
def test_decode_rule_never_brings_back_an_evicted_token(scope) -> None:
    """The decode rule chooses among the resident tokens only (GONE is absorbing), however
    much attention an evicted position draws."""
    ctx = make_ctx(1, 2, 1, 60)
    pol = make("voxzip", 0.25, scope=scope)
    pol.prefill(ctx, random_prefill(ctx))
    before = pol._keep.copy()
    evicted = np.flatnonzero(~before[0, 0])
    gone = int(evicted[len(evicted) // 2])
    att = np.zeros((1, 2, 60))
    att[..., gone] = 1.0  # every query's whole attention on an evicted position
    after = pol.update_scores(att, n_generated=1)
    assert not after[0, 0, gone]
    assert (after <= before).all()
    assert after.sum() == before.sum() - (scope == "generation")  # one evicted per step
    assert pol.scores_[0, 0, gone] >= 2.0 * 1.0 - 1e-9  # group sum added to the decayed score


def test_update_scores_refuses_attention_of_another_width() -> None:
    ctx = make_ctx(1, 2, 1, 50)
    pol = make("voxzip", 0.3)
    pol.prefill(ctx, random_prefill(ctx))
    with pytest.raises(ValueError, match="attention has 49 positions, the score 50"):
        pol.update_scores(np.zeros((1, 2, 49)), n_generated=1)


def test_recent_window_never_takes_the_sinks_share() -> None:
    """M = floor(fraction · b), capped by what the T sinks leave of the budget."""
    from kvsim.policies.voxzip import recent_count

    assert recent_count(30, 4, 0.2) == 6
    assert recent_count(10, 4, 0.8) == 6 and recent_count(10, 4, 1.0) == 6
    assert recent_count(3, 4, 1.0) == 0  # the sinks take the whole budget
    keep = sink_recent_topn(np.zeros((1, 40)), 10, 4, 1.0)
    assert np.flatnonzero(keep[0]).tolist() == [0, 1, 2, 3, *range(34, 40)]


def test_partition_of_no_rows_is_empty() -> None:
    from kvsim.policies.voxzip import partition_keep

    assert partition_keep(np.zeros((0, 6)), 1, 1, 3).shape == (0, 6)


def test_layer_scoring_is_the_sum_of_the_per_head_scores() -> None:
    """The recurrence is linear, so the layer's one vector is the sum of its KV-heads' vectors
    (a constant vector, or one KV-head's, would not be)."""
    ctx = make_ctx(2, 6, 3, 40)
    view = random_prefill(ctx, seed=4)
    head, layer = make("voxzip", 0.3), make("voxzip", 0.3, scoring="layer")
    head.prefill(ctx, view)
    layer.prefill(ctx, view)
    want = np.broadcast_to(head.scores_.sum(axis=1, keepdims=True), head.scores_.shape)
    np.testing.assert_allclose(layer.scores_, want, rtol=1e-6)


def test_decode_step_reads_every_layer_from_any_step_view() -> None:
    """A step view that is not the driver's one-buffer view is read layer by layer (here
    L = 3 layers, H_kv = 2): the same scores as the update from the stacked array."""
    ctx = make_ctx(3, 4, 2, 40)
    view = random_prefill(ctx)
    att = np.random.default_rng(2).dirichlet(np.ones(40), size=(3, 4)).astype(np.float32)
    a, b = make("voxzip", 0.5), make("voxzip", 0.5)
    a.prefill(ctx, view)
    b.prefill(ctx, view)
    step = FakeStepView(0, att)
    tiers = a.decode_step(step)
    assert step.read == [0, 1, 2]
    keep = b.update_scores(att, n_generated=1)
    np.testing.assert_array_equal(a.scores_, b.scores_)
    np.testing.assert_array_equal(tiers == Tier.GPU, keep)


def test_voxzip_variants_in_one_pass_keep_their_own_scores(tmp_path) -> None:
    """The prefill score is shared across the runs of one pass only between runs with the same
    γ and scoring: each variant replays in company as it replays alone."""
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=8.0, decode_steps=6, seed=5,
                                  store_values=False))
    trace = Trace(write_trace(tmp_path / "t.kvtrace", data))
    specs = [PolicySpec("voxzip", 0.2, {}), PolicySpec("voxzip", 0.2, {"gamma": 0.5}),
             PolicySpec("voxzip", 0.2, {"scoring": "layer"})]
    together = replay_trace(trace, specs, ReplayConfig(record_tiers=True))
    for spec, run in zip(specs, together, strict=True):
        (alone,) = replay_trace(trace, [spec], ReplayConfig(record_tiers=True))
        for got, want in zip(run.tiers, alone.tiers, strict=True):
            np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- scopes
def test_generation_scope_keep_hand_case() -> None:
    """b = 10, T = 4 sinks, M = 2: with g generated tokens the recent window's audio part is
    the last max(2 − g, 0) audio tokens and the audio keeps max(10 − g, 4) tokens."""
    scores = np.arange(20, dtype=float)[::-1].copy()[None]  # earlier positions score higher
    scores[0, 10] = 100.0  # one high-scoring middle token
    allowed = np.ones((1, 20), dtype=bool)
    k0 = generation_scope_keep(scores, allowed, 10, 0, 4, 0.2)
    assert np.flatnonzero(k0[0]).tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 18, 19]
    k1 = generation_scope_keep(scores, k0, 10, 1, 4, 0.2)  # recent audio: last 1; 9 kept
    assert np.flatnonzero(k1[0]).tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 19]
    k3 = generation_scope_keep(scores, k1, 10, 3, 4, 0.2)  # no recent audio left; 7 kept
    assert np.flatnonzero(k3[0]).tolist() == [0, 1, 2, 3, 4, 5, 10]
    k9 = generation_scope_keep(scores, k3, 10, 9, 4, 0.2)  # only the sinks are left
    assert np.flatnonzero(k9[0]).tolist() == [0, 1, 2, 3]
    # residency: a GONE position never comes back, however high its score
    scores[0, 7] = 1e6
    assert not generation_scope_keep(scores, k3, 10, 4, 4, 0.2)[0, 7]


def _replay_voxzip(scope: str, budget: float, tmp_path) -> tuple:
    data = synthesize(SynthConfig(preset="small", audio_seconds=30.0, decode_steps=40, seed=3,
                                  store_values=False))
    trace = Trace(write_trace(tmp_path / "t.kvtrace", data))
    (run,) = replay_trace(trace, [PolicySpec("voxzip", budget, {"scope": scope})],
                          ReplayConfig(record_tiers=True))
    return run, len(trace.audio_positions)


@pytest.mark.parametrize("budget", [0.05, 0.2])
def test_generation_scope_evicts_one_audio_token_per_head_and_step(budget, tmp_path) -> None:
    """VoxZip evicts "during the generation stage": every step's generated token takes one
    audio token's place in every (layer, KV-head) until only the sinks are left."""
    run, n_audio = _replay_voxzip("generation", budget, tmp_path)
    heads = run.facts.n_layers * run.facts.n_kv_heads
    b = int(np.floor(budget * n_audio + 1e-9))
    log = run.step_log
    g = log["step"].to_numpy() + 1
    want = heads * np.maximum(b - g, min(4, b))
    np.testing.assert_array_equal(log["gpu_audio_tokens"].to_numpy(), want)
    assert log["released_tokens"].sum() > 0  # decode-time eviction happens
    released = log["released_tokens"].to_numpy()
    np.testing.assert_array_equal(released, -np.diff(np.r_[heads * b, want]))
    hist = np.stack(run.tiers)  # (steps + 1, L, H, T_a)
    assert not ((hist[:-1] == Tier.GONE) & (hist[1:] != Tier.GONE)).any()  # GONE absorbing
    assert (hist[:, :, :, :min(4, b)] == Tier.GPU).all()  # the sinks, whatever their score
    # VoxZip's own ratio (audio + generated over L·H_kv·T_a) stays at the prefill value while
    # the budget can still hold the generated tokens
    r_cache = cache_retention(log["gpu_audio_tokens"].to_numpy(), g, heads, n_audio)
    fits = g <= b - min(4, b)
    np.testing.assert_allclose(r_cache[fits], heads * b / (heads * n_audio), rtol=0, atol=1e-12)
    assert run.summary["r_gpu"] < run.summary["r_gpu_prefill"]  # r_GPU (audio) falls


def test_audio_scope_is_static_after_prefill(tmp_path) -> None:
    """WnW §3.3's audio-only scope: the audio does not grow, the decode rule never evicts."""
    run, n_audio = _replay_voxzip("audio", 0.2, tmp_path)
    assert run.step_log["released_tokens"].sum() == 0
    assert run.summary["r_gpu"] == run.summary["r_gpu_prefill"]
    assert not make("voxzip", 0.2, scope="audio").needs_step_attention
    assert make("voxzip", 0.2).needs_step_attention  # the default scope reads step attention


def test_generation_scope_is_the_default() -> None:
    assert make("voxzip", 0.2).scope == "generation"
    with pytest.raises(ValueError, match="scope must be one of"):
        make("voxzip", 0.2, scope="all")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(["tiny", "small"]), seconds=st.floats(6.0, 16.0),
       steps=st.integers(1, 30), seed=st.integers(0, 10_000), budget=st.floats(0.02, 1.0),
       scoring=st.sampled_from(["head", "layer"]))
def test_generation_scope_budget_invariants_on_random_traces(preset, seconds, steps, seed,
                                                             budget, scoring) -> None:
    """Whatever the trace and budget: per (layer, KV-head) the audio on GPU after step s is
    exactly max(b − (s+1), min(T, b)), only resident tokens stay, sinks are never evicted,
    and the engine's capacity check held (it raises otherwise)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = synthesize(SynthConfig(preset=preset, audio_seconds=seconds, decode_steps=steps,
                                      seed=seed, store_values=False))
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        (run,) = replay_trace(trace, [PolicySpec("voxzip", budget, {"scoring": scoring})],
                              ReplayConfig(record_tiers=True))
        n_audio = len(trace.audio_positions)
    b = int(np.floor(budget * n_audio + 1e-9))
    sink = min(4, b)
    hist = np.stack(run.tiers)
    per_head = (hist == Tier.GPU).sum(-1)  # (steps + 1, L, H)
    want = np.r_[b, np.maximum(b - (np.arange(len(hist) - 1) + 1), sink)]
    assert (per_head == want[:, None, None]).all()
    assert not ((hist[:-1] != Tier.GPU) & (hist[1:] == Tier.GPU)).any()
    assert (hist[..., :sink] == Tier.GPU).all()


# ----------------------------------------------------------------------------- fast paths
def _partition_by_sort(scores, n_sink, n_recent, n_total, allowed):
    """partition_keep as specified: fixed positions, then the top-``left`` allowed others by
    a stable sort (ties to the earlier position)."""
    from kvsim.policies.base import topk_mask

    n = scores.shape[-1]
    fixed = np.zeros(n, dtype=bool)
    fixed[:n_sink] = True
    if n_recent > 0:
        fixed[n - n_recent:] = True
    keep = np.broadcast_to(fixed, scores.shape) & allowed
    left = n_total - keep.sum(axis=-1)
    cand = np.where(keep | ~allowed, -np.inf, scores)
    return keep | (topk_mask(cand, left) & ~keep & allowed)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(8, 40), st.integers(0, 5), st.integers(0, 6),
       st.sampled_from([2, 3, 5, 1000]))
def test_partition_keep_without_sorting_is_the_sorted_rule(seed, n, n_sink, n_recent, levels):
    """At most one candidate over the count per row (every decode step of the generation
    scope): the lowest-scoring one leaves, ties to the latest position; bit for bit the mask
    the stable sort gives, with few distinct scores (ties everywhere) or many, rows with one
    candidate too many and rows with none."""
    from kvsim.policies import voxzip

    rng = np.random.default_rng(seed)
    scores = rng.integers(0, levels, size=(3, 4, n)).astype(np.float64)
    fixed = np.zeros(n, dtype=bool)
    fixed[:n_sink] = True
    if n_recent:
        fixed[n - n_recent:] = True
    free = np.flatnonzero(~fixed)
    if len(free) == 0:
        return  # nothing outside the sinks and the recent window
    c = int(rng.integers(0, len(free)))  # candidates kept per row
    allowed = np.broadcast_to(fixed, scores.shape).copy()
    for row in np.ndindex(3, 4):  # c or c + 1 resident candidates: surplus 0 or 1
        allowed[row][rng.choice(free, size=c + int(rng.integers(0, 2)), replace=False)] = True
    n_total = int(fixed.sum()) + c
    calls = []
    real = voxzip._drop_lowest
    try:
        voxzip._drop_lowest = lambda *a: calls.append(1) or real(*a)
        got = voxzip.partition_keep(scores, n_sink, n_recent, n_total, allowed)
    finally:
        voxzip._drop_lowest = real
    assert calls  # the fast path ran
    np.testing.assert_array_equal(got, _partition_by_sort(scores, n_sink, n_recent, n_total, allowed))


def test_generation_scope_decode_steps_match_the_sorted_rule() -> None:
    """A whole run of decode steps of the generation scope: the rule applied through the fast
    path keeps exactly what the sorted rule keeps, step after step."""
    from kvsim.policies.voxzip import recent_count

    rng = np.random.default_rng(3)
    scores = rng.integers(0, 4, size=(2, 3, 80)).astype(np.float64)
    budget, sink = 30, 4
    recent = recent_count(budget, sink, 0.2)
    keep = sink_recent_topn(scores, budget, sink, 0.2)
    for g in range(1, 40):
        scores = 0.95 * scores + rng.integers(0, 3, size=scores.shape)
        want = _partition_by_sort(scores, sink, max(recent - g, 0), max(budget - g, sink), keep)
        keep = generation_scope_keep(scores, keep, budget, g, sink, 0.2)
        np.testing.assert_array_equal(keep, want)
    assert (keep.sum(axis=-1) == sink).all()


@pytest.mark.parametrize("scoring", ["head", "layer"])
def test_update_scores_is_the_recurrence_layer_by_layer(scoring) -> None:
    """All layers at once: the same float32 group sums and float64 γ·A + a as
    decayed_accumulate on each layer's GQA-summed rows, bit for bit."""
    ctx = make_ctx(3, 6, 2, 50)
    pol = make("voxzip", 0.4, scoring=scoring)
    pol.prefill(ctx, random_prefill(ctx))
    before = pol.scores_.copy()
    att = np.random.default_rng(1).dirichlet(np.ones(50), size=(3, 6)).astype(np.float32)
    pol.update_scores(att, n_generated=1)
    for layer in range(3):
        rows = att[layer].reshape(2, 3, 50).sum(axis=1)
        if scoring == "layer":
            rows = np.broadcast_to(rows.sum(axis=0), rows.shape)
        np.testing.assert_array_equal(pol.scores_[layer], decayed_accumulate(before[layer], rows, 0.95))
