"""Analytic tests of the SimPy hardware model (issue 4 'What it must show')."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.core.steplog import RunFacts
from kvsim.sim import (
    AnalyticPolicy,
    HbmLedger,
    HbmOutOfMemory,
    PcieLink,
    SimMode,
    StepWorkload,
    Stream,
    analytic_workload,
    gpu_preset,
    max_batch,
    model_preset,
    runtime_preset,
    simulate_workload,
    transfer_us,
)
from kvsim.sim.engine import step_costs


def _copy(env, stream, nbytes, gbps, alpha, channel):
    return stream.launch(transfer_us(nbytes, gbps, alpha), channel=channel)


def test_one_transfer_takes_alpha_plus_bytes_over_beta():
    env = simpy.Environment()
    link = PcieLink(env)
    s = Stream(env, "copy")
    done = _copy(env, s, 1_000_000, 25.0, 2.0, link.h2d)
    env.run()
    assert done.processed
    assert env.now == pytest.approx(2.0 + 1_000_000 / 25e3)  # alpha + B / beta, in us


def test_n_copies_cost_n_alphas_plus_total_bytes():
    assert transfer_us(4096 * 10, 25.0, 2.0, 10) == pytest.approx(10 * 2.0 + 40960 / 25e3)
    assert transfer_us(0, 25.0, 2.0, 3) == 0.0


def test_two_copies_on_one_stream_serialise():
    env = simpy.Environment()
    link = PcieLink(env)
    s = Stream(env, "copy")
    d = transfer_us(1e6, 25.0, 2.0)
    a = _copy(env, s, 1e6, 25.0, 2.0, link.h2d)
    b = s.launch(transfer_us(1e6, 25.0, 2.0), channel=link.d2h)  # other direction, same stream
    env.run()
    assert a.processed and b.processed
    assert env.now == pytest.approx(2 * d)


def test_two_copies_on_two_streams_overlap_full_duplex():
    env = simpy.Environment()
    link = PcieLink(env)
    s1, s2 = Stream(env, "h2d"), Stream(env, "d2h")
    d = transfer_us(1e6, 25.0, 2.0)
    s1.launch(d, channel=link.h2d)
    s2.launch(d, channel=link.d2h)
    env.run()
    assert env.now == pytest.approx(d)


def test_same_direction_copies_on_two_streams_share_the_link():
    env = simpy.Environment()
    link = PcieLink(env)
    s1, s2 = Stream(env, "a"), Stream(env, "b")
    s1.launch(10.0, channel=link.h2d)
    s2.launch(10.0, channel=link.h2d)
    env.run()
    assert env.now == pytest.approx(20.0)


def test_copy_and_kernel_on_two_streams_overlap_and_events_order_them():
    env = simpy.Environment()
    link = PcieLink(env)
    copy, compute = Stream(env, "copy"), Stream(env, "compute")
    ev = copy.launch(30.0, channel=link.h2d)
    compute.launch(20.0)  # independent kernel overlaps the copy
    k2 = compute.launch(5.0, wait=(ev,), tag=0)  # cudaStreamWaitEvent on the copy
    env.run()
    assert env.now == pytest.approx(35.0)
    assert k2.processed
    assert compute.stall_us[0] == pytest.approx(10.0)  # waited from t=20 to t=30


def _critical_path(issue: list[float], dur: list[float]) -> float:
    """Reference: ops issued at ``issue`` times run FIFO on one stream."""
    end = 0.0
    for t, d in zip(issue, dur, strict=True):
        end = max(end, t) + d
    return end


@pytest.mark.parametrize("host_us_per_op", [0.5, 4.0, 40.0])
def test_step_time_is_the_critical_path_of_host_and_compute(host_us_per_op):
    gpu = gpu_preset("h100-sxm")
    model = model_preset("minivox")
    rt = dataclasses.replace(runtime_preset("hf-sdpa"), host_us_per_op=host_us_per_op,
                             cache_copy_factor=0.0)
    wl = analytic_workload(model, AnalyticPolicy("full"), 20.0, n_decode=3)
    res = simulate_workload(wl, gpu, "sync", model=model, runtime=rt)
    c = step_costs(gpu, model, rt, 1, False)
    L = model.n_layers
    # GPU time per layer at step 0, recomputed from the same formula inputs
    kvb = model.kv_bytes_per_head_token
    read = (wl.non_audio_tokens[0] * model.n_kv_heads + wl.read_audio_tokens[0] / L) * kvb
    g = max(c.layer_weight_us + read * c.kv_read_us_per_byte, c.layer_min_us)
    issue = [(i + 1) * c.host_layer_us for i in range(L)] + [L * c.host_layer_us + c.host_head_us]
    dur = [g] * L + [c.gpu_head_us]
    expected = max(_critical_path(issue, dur), issue[-1]) + c.host_step_fixed_us
    assert res.raw.step_us[0] == pytest.approx(expected, rel=1e-6)
    # and it is at least each resource's own busy time
    assert res.raw.step_us[0] >= L * c.host_layer_us + c.host_head_us
    assert res.raw.step_us[0] >= L * g + c.gpu_head_us


def _one_copy_workload(model, tokens: int, runs: int, step: int = 0, n_steps: int = 4):
    base = analytic_workload(model, AnalyticPolicy("snapkv", 0.2), 20.0, n_decode=n_steps)
    tok = np.zeros_like(base.h2d_tokens_by_layer)
    r = np.zeros_like(tok)
    tok[step, 0] = tokens
    r[step, 0] = runs
    return dataclasses.replace(base, h2d_tokens_by_layer=tok, h2d_runs_by_layer=r,
                               h2d_segments_by_layer=r.copy())


def test_sync_recall_adds_exactly_api_plus_alpha_plus_bytes_over_beta():
    gpu, model, rt = gpu_preset("a100-80gb"), model_preset("minivox"), runtime_preset("hf-sdpa")
    none = simulate_workload(_one_copy_workload(model, 0, 0), gpu, "sync-run", model=model, runtime=rt)
    one = simulate_workload(_one_copy_workload(model, 100, 1), gpu, "sync-run", model=model, runtime=rt)
    nbytes = 100 * model.kv_bytes_per_head_token
    host = gpu.memcpy_api_us + 2 * rt.host_us_per_op
    alpha = gpu.pcie_latency_us + gpu.pageable_extra_us
    expected = host + alpha + nbytes / (gpu.pcie_h2d_pageable_gbps * 1e3)
    assert one.raw.step_us[0] - none.raw.step_us[0] == pytest.approx(expected, rel=1e-9)
    assert one.raw.step_us[1] == pytest.approx(none.raw.step_us[1])
    assert one.raw.host_copy_us[0] == pytest.approx(expected)


def test_overlapped_recall_hides_the_copy_but_not_the_api_cost():
    gpu, model, rt = gpu_preset("a100-80gb"), model_preset("minivox"), runtime_preset("hf-sdpa")
    none = simulate_workload(_one_copy_workload(model, 0, 0), gpu, "overlap-run", model=model, runtime=rt)
    one = simulate_workload(_one_copy_workload(model, 100, 1), gpu, "overlap-run", model=model, runtime=rt)
    host = gpu.memcpy_api_us + 2 * rt.host_us_per_op
    total = (one.raw.step_us[:2] - none.raw.step_us[:2]).sum()
    assert total == pytest.approx(host, rel=1e-9)  # host-bound: the copy itself is hidden


def test_huge_recall_stalls_compute_in_overlap_mode():
    gpu, model, rt = gpu_preset("a100-80gb"), model_preset("minivox"), runtime_preset("hf-sdpa")
    big = 10_000_000  # ~2.5 GB: far longer than a step
    res = simulate_workload(_one_copy_workload(model, big, 1), gpu, "overlap-run", model=model, runtime=rt)
    assert res.raw.compute_stall_us[1] > 0.5 * big * model.kv_bytes_per_head_token / 25e3
    assert res.summary()["transfer_wait_share"] > 0.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10**9)), min_size=1, max_size=40))
def test_high_water_mark_is_peak_of_sum_of_live_allocations(ops):
    led = HbmLedger(capacity_bytes=2**62)
    live: list[int] = []
    sizes: dict[int, int] = {}
    running, peak = 0, 0
    for is_alloc, n in ops:
        if is_alloc or not live:
            h = led.alloc("x", n)
            live.append(h)
            sizes[h] = n
            running += n
        else:
            h = live.pop(n % len(live))
            led.free(h)
            running -= sizes[h]
        peak = max(peak, running)
        assert led.live == running
    assert led.high_water == peak


def test_ledger_strict_raises_beyond_capacity():
    led = HbmLedger(100, strict=True)
    led.alloc("a", 60)
    with pytest.raises(HbmOutOfMemory, match="out of memory"):
        led.alloc("b", 50)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["voxtral-mini-3b", "qwen2.5-omni-3b", "minivox", "voxtral-small-24b"]),
    st.floats(0.1, 0.9),
    st.integers(0, 60),
    st.integers(1, 60),
    st.floats(30.0, 600.0),
)
def test_more_tidal_heads_never_lower_mb_per_step(name, r, n1, extra, audio_s):
    model = model_preset(name)
    heads = model.n_layers * model.n_kv_heads
    anchors = 5
    if r * heads < anchors:
        r = anchors / heads + 0.01
    n1 = min(n1, heads - anchors - 1)
    n2 = min(n1 + extra, heads - anchors)
    a = analytic_workload(model, AnalyticPolicy("wnw", r, tidal_heads=n1), audio_s)
    b = analytic_workload(model, AnalyticPolicy("wnw", r, tidal_heads=n2), audio_s)
    assert b.h2d_bytes.mean() >= a.h2d_bytes.mean()
    assert (b.h2d_bytes >= a.h2d_bytes).all()


def test_more_tidal_heads_never_lower_simulated_mb_per_step():
    model = model_preset("voxtral-mini-3b")
    mbs = []
    for n in (0, 35, 75, 115, 155, 195, 235):
        wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=n), 240.0)
        mbs.append(simulate_workload(wl, "h100-sxm", "sync").summary()["h2d_mb_per_step"])
    assert mbs[0] == 0.0
    assert all(b >= a for a, b in zip(mbs, mbs[1:], strict=False))
    assert mbs[-1] > mbs[1] > 0


def test_overlap_is_never_slower_than_sync_and_coalescing_cuts_copies():
    model = model_preset("voxtral-mini-3b")
    wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=235), 240.0)
    sync = simulate_workload(wl, "a100-80gb", "sync").summary()
    ovl = simulate_workload(wl, "a100-80gb", "overlap").summary()
    coal = simulate_workload(wl, "a100-80gb", "coalesced").summary()
    run = simulate_workload(wl, "a100-80gb", "overlap-run").summary()
    assert ovl["ms_per_token_mean"] <= sync["ms_per_token_mean"]
    assert coal["h2d_copies_per_step"] < ovl["h2d_copies_per_step"] < run["h2d_copies_per_step"]
    assert coal["ms_per_token_mean"] <= ovl["ms_per_token_mean"]
    assert sync["h2d_mb_per_step"] == ovl["h2d_mb_per_step"] == coal["h2d_mb_per_step"]
    assert 0 < sync["transfer_wait_share"] < 1


def test_wnw_table4_trend_emerges_host_bound():
    """The paper's < 5% spread across 35..235 tidal heads is a prediction of the model (the
    step is host-bound and recalls happen only when the frontier crosses a segment)."""
    model = model_preset("voxtral-mini-3b")
    med = []
    for n in (35, 235):
        wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=n), 240.0)
        med.append(simulate_workload(wl, "h100-sxm", "sync", runtime="hf-eager").summary())
    spread = med[1]["ms_per_token_median"] / med[0]["ms_per_token_median"] - 1
    assert abs(spread) < 0.05
    assert med[1]["ms_per_token_mean"] > med[0]["ms_per_token_mean"]


def test_memory_over_steps_grows_with_generated_tokens_and_oscillates_with_recall():
    model = model_preset("voxtral-mini-3b")
    wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=85), 240.0)
    res = simulate_workload(wl, "h100-sxm", "sync")
    mem = res.per_step["gpu_bytes"].to_numpy()
    assert mem[-1] > mem[0]
    assert res.summary()["peak_gpu_bytes"] == mem.max()
    # weights dominate: peak within a few GiB of the weights for one sequence
    assert model.weight_bytes < mem.max() < model.weight_bytes + 3 * 2**30


def test_max_batch_fits_and_one_more_does_not():
    model = model_preset("voxtral-mini-3b")
    wl = analytic_workload(model, AnalyticPolicy("snapkv", 0.2), 240.0, n_decode=50)
    b = max_batch(wl, "h100-sxm", "sync")
    assert b > 1
    simulate_workload(wl, "h100-sxm", "sync", batch=b, strict_memory=True)
    with pytest.raises(HbmOutOfMemory):
        simulate_workload(wl, "h100-sxm", "sync", batch=b + 1, strict_memory=True)
    full = analytic_workload(model, AnalyticPolicy("full"), 240.0, n_decode=50)
    assert max_batch(full, "h100-sxm", "sync") < b


def test_cuda_graphs_remove_per_kernel_launch_cost():
    model = model_preset("voxtral-mini-3b")
    wl = analytic_workload(model, AnalyticPolicy("full"), 60.0, n_decode=5)
    eager = simulate_workload(wl, "h100-sxm", "sync").summary()["ms_per_token_mean"]
    graphs = simulate_workload(wl, "h100-sxm", "sync+graphs").summary()["ms_per_token_mean"]
    assert graphs < eager / 2


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ("sync", SimMode("sync", "segment", False)),
        ("overlap", SimMode("overlap", "segment", True)),
        ("coalesced", SimMode("overlap", "layer", True)),
        ("overlap+graphs", SimMode("overlap", "segment", True, True)),
        ("recall=overlap,granularity=run", SimMode("overlap", "run", True)),
        ("recall=sync,pinned=true", SimMode("sync", "segment", True)),
    ],
)
def test_mode_parse(spec, expect):
    assert SimMode.parse(spec) == expect


def test_in_layer_recall_for_query_aware_policies():
    model = model_preset("minivox")
    wl = _one_copy_workload(model, 1000, 5)
    wl.facts = dataclasses.replace(wl.facts, policy="arkvale")
    res = simulate_workload(wl, "h100-sxm", "sync", model=model)
    assert res.raw.host_copy_us[0] > 0  # copies happen inside step 0
    facts = RunFacts(**{**wl.facts.to_json(), "policy": "wnw"})
    assert isinstance(facts, RunFacts)


def test_workload_shapes():
    model = model_preset("qwen2.5-omni-3b")
    wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=22), 240.0)
    assert isinstance(wl, StepWorkload)
    assert wl.h2d_tokens_by_layer.shape == (wl.n_steps, 36)
    assert wl.facts.n_audio == 6000  # 4 min at 25 tok/s
    assert wl.n_steps == round(240 * 2.5 * 1.3)


def test_counting_transfers_matters_as_much_as_bytes():
    """docs/simulator.md: 480 small copies at ~5 us cost more than 1 MB at 50 GB/s."""
    gpu, model = gpu_preset("h100-sxm"), model_preset("voxtral-mini-3b")
    tokens = 1_000_000 // model.kv_bytes_per_head_token  # ~1 MB
    many = simulate_workload(_one_copy_workload(model, tokens, 480), gpu, "sync-run", model=model)
    one = simulate_workload(_one_copy_workload(model, tokens, 1), gpu, "sync-run", model=model)
    many_ms, one_ms = many.raw.host_copy_us[0], one.raw.host_copy_us[0]
    assert one_ms < 1e6 / (gpu.pcie_h2d_pageable_gbps * 1e3) + 50  # ~bandwidth-bound
    assert many_ms > 480 * gpu.memcpy_api_us  # call-overhead-bound
    assert many_ms > 10 * one_ms


def test_cpu_tier_bytes_reported():
    model = model_preset("voxtral-mini-3b")
    wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=85), 240.0)
    s = simulate_workload(wl, "h100-sxm", "sync", batch=2).summary()
    one = simulate_workload(wl, "h100-sxm", "sync").summary()
    assert s["peak_cpu_bytes"] == 2 * one["peak_cpu_bytes"] > 0
    snap = analytic_workload(model, AnalyticPolicy("snapkv", 0.2), 240.0)
    assert simulate_workload(snap, "h100-sxm", "sync").summary()["peak_cpu_bytes"] == 0


def _reference_overlap_run(wl, gpu, model, rt):
    """Independent recurrence for mode 'overlap-run' (pinned, one copy per run, after-step
    recall): host issues layers then copies; compute waits on last step's per-layer copy."""
    c = step_costs(gpu, model, rt, 1, False)
    L, kvb = wl.n_layers, model.kv_bytes_per_head_token
    h_copy = gpu.memcpy_api_us + 2 * rt.host_us_per_op
    t, end, copy_free = 0.0, 0.0, 0.0
    prev_done: dict[int, float] = {}
    steps = []
    for s in range(wl.n_steps):
        start = t
        read = (wl.non_audio_tokens[s] * model.n_kv_heads + wl.read_audio_tokens[s] / L) * kvb
        resident = (wl.non_audio_tokens[s] * model.n_kv_heads + wl.gpu_audio_tokens[s] / L) * kvb
        g = max(c.layer_weight_us + read * c.kv_read_us_per_byte
                + rt.cache_copy_factor * resident * c.stream_us_per_byte, c.layer_min_us)
        for ly in range(L):
            t += c.host_layer_us
            end = max(end, t, prev_done.get(ly, 0.0)) + g
        t += c.host_head_us
        end = max(end, t) + c.gpu_head_us
        t = max(t, end) + c.host_step_fixed_us
        prev_done = {}
        for ly in range(L):
            n = int(wl.h2d_runs_by_layer[s, ly])
            if n == 0:
                continue
            b = float(wl.h2d_tokens_by_layer[s, ly] * kvb)
            cpy = transfer_us(b, gpu.pcie_h2d_pinned_gbps, gpu.pcie_latency_us, n) / n
            t += h_copy
            copy_free = max(copy_free, t) + cpy + (n - 1) * max(h_copy, cpy)
            prev_done[ly] = copy_free
            t += (n - 1) * h_copy
        steps.append(t - start)
    return np.array(steps)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.floats(0.01, 20.0),
    st.sampled_from(["a100-80gb", "h100-sxm"]),
)
def test_engine_matches_independent_recurrence_overlap(seed, host_us_per_op, gpu_name):
    rng = np.random.default_rng(seed)
    model = model_preset("minivox")
    gpu = gpu_preset(gpu_name)
    rt = dataclasses.replace(runtime_preset("hf-sdpa"), host_us_per_op=host_us_per_op)
    base = analytic_workload(model, AnalyticPolicy("snapkv", 0.3), 30.0, n_decode=6)
    L = model.n_layers
    runs = rng.integers(0, 4, size=(6, L)) * (rng.random((6, L)) < 0.3)
    tok = runs * rng.integers(1, 20_000, size=(6, L))
    wl = dataclasses.replace(base, h2d_tokens_by_layer=tok, h2d_runs_by_layer=runs,
                             h2d_segments_by_layer=runs.copy())
    res = simulate_workload(wl, gpu, "overlap-run", model=model, runtime=rt)
    np.testing.assert_allclose(res.raw.step_us, _reference_overlap_run(wl, gpu, model, rt),
                               rtol=1e-9)


def test_churn_adds_refetch_traffic_linearly():
    model = model_preset("voxtral-mini-3b")
    mb = []
    for churn in (0.0, 0.1, 0.2):
        wl = analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=100,
                                                     churn_segments_per_step=churn), 240.0)
        mb.append(wl.h2d_bytes.mean())
    per_entry = 100 * (25 - round((0.2 * 240 - 5) / 235 * 25)) * 512
    assert mb[1] - mb[0] == pytest.approx(0.1 * per_entry, rel=0.02)
    assert mb[2] - mb[1] == pytest.approx(0.1 * per_entry, rel=0.02)


def test_churn_memory_does_not_grow_with_its_value():
    """The churned segments in flight are kept as one count per step (at most ``lag``
    entries), not one entry per segment: a churn of 1e6 per step costs no more memory."""
    from kvsim.sim.analytic import _Churn

    churn = _Churn(1e6, 3)
    for s in range(50):
        assert churn.step(s) == 1_000_000
        assert len(churn.live) <= 3 and churn.n_live == min(s + 1, 3) * 1_000_000


def test_churn_same_workload_as_per_segment_bookkeeping():
    """Fractional churn: the re-fetches and residents of the count-per-step bookkeeping equal
    those of one entry per segment (the definition)."""
    from kvsim.sim.analytic import _Churn

    churn, acc, live = _Churn(2.37, 4), 0.0, []
    for s in range(40):
        acc += 2.37
        n = int(acc)
        acc -= n
        live = [t for t in live if s - t < 4] + [s] * n
        assert churn.step(s) == n and churn.n_live == len(live)


def test_churn_above_the_audio_segment_count_is_refused():
    from kvsim.sim import AnalyticError

    model = model_preset("voxtral-mini-3b")
    n_seg = 240 // 2  # 240 s of 2-s segments
    analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=35, churn_segments_per_step=n_seg), 240.0)
    with pytest.raises(AnalyticError, match=r"--churn.*<= 120"):
        analytic_workload(model, AnalyticPolicy("wnw", 0.2, tidal_heads=35, churn_segments_per_step=1e9), 240.0)
