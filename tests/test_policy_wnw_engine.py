"""Engine-driven property tests of the zoo-a policies on random synthetic traces.

Every case synthesises a small trace (real q/k, ``kvsim.synth``), replays it with the real
engine (which itself checks dtype/shape, GONE absorbing and ``gpu_capacity`` at every step)
and then checks, on the recorded tiers after prefill and after every step:

* protocol invariants (docs/design.md): GONE absorbing; a position becomes GPU only from GPU or CPU;
  the GPU budget ``floor(r · L · H_kv · T_a)`` holds at every step; r_GPU <= r_GPU+CPU <= 1;
* WnW: anchors keep everything; fixed heads never recall (never CPU, never change); tidal
  heads never lose a position (never GONE) and keep their prefill subset on GPU; only tidal
  heads recall; per-segment prefill never empties a segment;
* static policies (adakv, pyramidkv, audiokv, voxzip): tiers never change after prefill, no
  CPU tier, measured r_GPU within ±0.01 of the target.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.policies._wnw_layout import ANCHOR, FIXED, TIDAL, SegmentLayout
from kvsim.policies.base import Tier
from kvsim.policies.registry import make
from kvsim.policies.wnw import WnWBudgetWarning
from kvsim.replay.engine import PolicySpec, ReplayConfig, Replayer, replay_trace
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace

SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _trace(preset: str, seconds: float, steps: int, seed: int, tmp: Path) -> Trace:
    data = synthesize(
        SynthConfig(preset=preset, audio_seconds=seconds, decode_steps=steps, seed=seed,
                    store_values=False)
    )
    return Trace(write_trace(tmp / "t.kvtrace", data))


def _replay(trace: Trace, spec: PolicySpec):
    (run,) = replay_trace(trace, [spec], ReplayConfig(record_tiers=True, topk=8))
    return run


def _common_invariants(run, budget_tokens: int) -> None:
    hist = run.tiers
    for prev, new in zip(hist, hist[1:], strict=False):
        assert not ((prev == Tier.GONE) & (new != Tier.GONE)).any()  # GONE absorbing
        assert not ((new == Tier.GPU) & (prev == Tier.GONE)).any()  # GPU only from GPU/CPU
    for t in hist:
        assert int((t == Tier.GPU).sum()) <= budget_tokens  # the budget at every step
    s = run.summary
    assert s["r_gpu"] <= s["r_gpu_cpu"] + 1e-12 <= 1.0 + 1e-9


def _wnw_params(recall: bool) -> st.SearchStrategy:
    """WnW hyperparameters. ``recall=True`` builds configurations on the recall path by
    construction (anchors to observe, tidal heads to recall into, a budget below λ's
    saturation, room for a recall in ``"step"`` mode); ``False`` also reaches the edges (no
    anchors, no tidal heads, saturated λ, infeasible budgets)."""
    wide = st.integers(0, 8)
    return st.fixed_dictionaries(
        {
            "n_anchor": st.integers(1, 2) if recall else st.integers(0, 5),
            "n_tidal": st.integers(2, 6) if recall else wide,  # n_voice = anchors + tidal
            "default_n_voice": st.just(False) if recall else st.booleans(),  # or None
            "top_k": st.integers(1, 4),
            "delta": st.integers(1, 4),
            "stride_seconds": st.sampled_from([0.5, 1.0, 2.0]),
            "chunk_mult": st.integers(1, 3),
            "prefill_selection": st.sampled_from(["segment", "global"]),
            "triage_signal": st.sampled_from(["vs_hs", "vs", "hs"]),
            "min_per_segment": st.sampled_from([0, 1]),
            "reserve_segments": st.one_of(st.none(), st.integers(2, 8) if recall else wide),
            "budget_mode": st.sampled_from(["paper", "step"]),
        }
    )


_WNW_RECALLED: list[bool] = []


def _check_wnw_invariants(preset, seconds, steps, seed, budget, params) -> None:
    params = dict(params)
    params["chunk_seconds"] = params["stride_seconds"] * params.pop("chunk_mult")
    n_voice = params["n_anchor"] + params.pop("n_tidal")
    params["n_voice"] = None if params.pop("default_n_voice") else n_voice
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", WnWBudgetWarning)
        trace = _trace(preset, seconds, steps, seed, Path(tmp))
        ctx = Replayer(trace, ReplayConfig()).ctx
        pol = make("wnw", budget, **params)
        run = _replay(trace, PolicySpec("wnw", budget, params))
        # a twin policy gives the roles the replayed one used (the plan is a pure function
        # of the context and the hyperparameters)
        lay = SegmentLayout.from_seconds(ctx.n_audio, ctx.audio_tokens_per_s,
                                         params["chunk_seconds"], params["stride_seconds"])
        pol._plan(ctx, pol._signal(ctx), lay.seg_len)
    B = ctx.budget_tokens(budget)
    if params["budget_mode"] == "step":
        _common_invariants(run, B)  # the budget is a hard cap at every step
    else:  # paper accounting: prefill meets B, the engine asserted the worst-case capacity
        assert int((run.tiers[0] == Tier.GPU).sum()) <= B
        _common_invariants(run, ctx.audio_kv_total)
    _wnw_role_invariants(run, pol, lay, params)


@SETTINGS
@given(
    preset=st.sampled_from(["tiny", "small"]),
    seconds=st.floats(3.0, 16.0),
    steps=st.integers(2, 24),
    seed=st.integers(0, 10_000),
    budget=st.floats(0.05, 1.0),
    params=_wnw_params(recall=False),
)
def test_wnw_invariants_on_random_traces(preset, seconds, steps, seed, budget, params) -> None:
    _check_wnw_invariants(preset, seconds, steps, seed, budget, params)


# derandomized: the recall share below is a property of these 20 draws, the same on every run
# and machine (a fresh random set of 20 made the threshold a coin toss: 13 of 20 on one CI run)
@settings(SETTINGS, derandomize=True, database=None)
@given(
    seconds=st.floats(6.0, 16.0),
    steps=st.integers(8, 24),
    seed=st.integers(0, 10_000),
    budget=st.floats(0.3, 0.6),
    params=_wnw_params(recall=True),
)
def _check_wnw_recall_path(seconds, steps, seed, budget, params) -> None:
    _check_wnw_invariants("small", seconds, steps, seed, budget, params)


def _wnw_role_invariants(run, pol, lay, params) -> None:
    roles = pol.roles_
    anchor, tidal, fixed = roles == ANCHOR, roles == TIDAL, roles == FIXED
    t0 = run.tiers[0]
    for t in run.tiers:
        assert (t[anchor] == Tier.GPU).all()  # anchors keep everything
        assert (t[fixed] == t0[fixed]).all()  # fixed heads never change...
        assert not (t[fixed] == Tier.CPU).any()  # ...and have nothing to recall
        assert not (t[tidal] == Tier.GONE).any()  # tidal complement stays on CPU
        assert (t[tidal][t0[tidal] == Tier.GPU] == Tier.GPU).all()  # prefill subset stays
    recalled = sum(int(x) for x in run.step_log["h2d_tokens"])
    _WNW_RECALLED.append(recalled > 0)
    if not tidal.any():
        assert recalled == 0
    if params["prefill_selection"] == "segment" and pol.min_per_segment_ == 1:
        per_seg = np.add.reduceat((t0 == Tier.GPU).astype(np.int64), lay.seg_bounds[:, 0], axis=-1)
        assert (per_seg[~anchor] >= 1).all()  # no segment wholly evicted at prefill


def test_wnw_invariants_on_the_recall_path_and_recall_share() -> None:
    """The invariants on configurations built for the recall path, and most of them do
    recall (a wide strategy recalled in 2 of 20 examples; see the measured share in the
    docs). Not every one must: the top-k chunks can coincide with resident segments."""
    _WNW_RECALLED.clear()
    _check_wnw_recall_path()
    share = float(np.mean(_WNW_RECALLED))
    print(f"wnw: {sum(_WNW_RECALLED)} of {len(_WNW_RECALLED)} draws recall")
    assert len(_WNW_RECALLED) >= 10 and share >= 0.7, (share, len(_WNW_RECALLED))  # 20 of 20


def test_wnw_recall_is_active_and_oscillates_on_a_sweeping_trace(tmp_path: Path) -> None:
    trace = _trace("small", 40.0, 60, 1, tmp_path)
    # small: 8 KV-heads, T_a = 500; one anchor alone is 1/8 of the audio KV
    run = _replay(trace, PolicySpec("wnw", 0.4, {"n_voice": 6, "n_anchor": 1,
                                                  "budget_mode": "step"}))
    log = run.step_log
    B = int(np.floor(0.4 * 4 * 2 * 500 + 1e-9))
    assert log["gpu_audio_tokens"].max() <= B
    assert log["h2d_tokens"].sum() > 0 and log["released_tokens"].sum() > 0
    assert log["gpu_audio_tokens"].n_unique() > 1  # recall/release oscillation (Fig. 4)
    s = run.summary
    assert s["r_gpu_cpu"] > s["r_gpu"] + 0.05  # the tidal CPU complement
    # recalled positions move forward with the generation frontier (speech is time-ordered)
    hist = np.stack(run.tiers)  # (steps+1, L, H, T)
    tidal = (hist == Tier.CPU).any(axis=(0, 3))  # (L, H): heads with a CPU complement
    extra = ((hist[:, tidal] == Tier.GPU) & (hist[0, tidal] != Tier.GPU)).sum(axis=1)  # (S, T)
    centre = [(np.arange(extra.shape[1]) * e).sum() / e.sum() for e in extra[1:] if e.sum()]
    assert len(centre) > 10 and centre[-1] > centre[0] + 100


@SETTINGS
@given(
    name=st.sampled_from(["adakv", "pyramidkv", "audiokv", "voxzip"]),
    preset=st.sampled_from(["tiny", "small"]),
    seconds=st.floats(8.0, 20.0),
    steps=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    budget=st.floats(0.05, 1.0),
)
def test_static_policies_on_random_traces(name, preset, seconds, steps, seed, budget) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trace = _trace(preset, seconds, steps, seed, Path(tmp))
        # voxzip's default (VoxZip's generation scope) evicts while decoding; the audio-only
        # scope is the static one (tests/test_policy_voxzip.py covers the other)
        params = {"scope": "audio"} if name == "voxzip" else {}
        run = _replay(trace, PolicySpec(name, budget, params))
        n_audio = len(trace.audio_positions)
    L, Hkv = run.facts.n_layers, run.facts.n_kv_heads
    B = int(np.floor(budget * L * Hkv * n_audio + 1e-9))
    _common_invariants(run, B)
    t0 = run.tiers[0]
    assert not (t0 == Tier.CPU).any()
    for t in run.tiers[1:]:
        assert (t == t0).all()
    assert abs(run.summary["r_gpu"] - budget) <= 0.01
    assert run.summary["r_gpu"] == run.summary["r_gpu_cpu"]


@pytest.mark.parametrize("name", ["wnw", "adakv", "pyramidkv", "audiokv", "voxzip"])
def test_engine_runs_every_zoo_a_policy_at_paper_budgets(name: str, tmp_path: Path) -> None:
    trace = _trace("small", 30.0, 20, 0, tmp_path)
    # small has 8 KV-heads: the paper's 5 anchors (37.5% at n_voice = 3) exceed r = 0.2
    params = {"n_anchor": 1} if name == "wnw" else {"scope": "audio"} if name == "voxzip" else {}
    runs = replay_trace(trace, [PolicySpec(name, r, params) for r in (0.2, 0.4, 0.6, 0.8)],
                        ReplayConfig())
    for run, r in zip(runs, (0.2, 0.4, 0.6, 0.8), strict=True):
        s = run.summary
        if name != "wnw":
            assert s["r_gpu_max"] <= r + 1e-9
            assert abs(s["r_gpu"] - r) <= 0.01
        else:  # §3.4: prefill meets the target, recalls come on top
            assert r - 0.01 <= s["r_gpu_prefill"] <= r + 1e-9
            assert s["r_gpu"] >= s["r_gpu_prefill"] - 1e-9


def test_anchor_heads_see_their_true_attention_and_full_budget_keeps_all(tmp_path: Path) -> None:
    trace = _trace("small", 30.0, 15, 3, tmp_path)
    ctx = Replayer(trace, ReplayConfig()).ctx
    run_full, run = replay_trace(
        trace,
        [PolicySpec("wnw", 1.0), PolicySpec("wnw", 0.5, {"n_voice": 4, "n_anchor": 2})],
        ReplayConfig(record_tiers=True),
    )
    assert run_full.summary["r_gpu"] == 1.0 and run_full.summary["attn_recall"] == 1.0
    pol = make("wnw", 0.5, n_voice=4, n_anchor=2)
    lay = SegmentLayout.from_seconds(ctx.n_audio, ctx.audio_tokens_per_s, 4.0, 2.0)
    pol._plan(ctx, pol._signal(ctx), lay.seg_len)
    anchor_q = np.repeat(pol.roles_ == ANCHOR, ctx.heads.group, axis=1)  # (L, H_q)
    assert anchor_q.sum() == 2 * ctx.heads.group
    # eq. 2 reads the engine's compressed attention; for anchors it is the full attention
    # exact by construction: an anchor keeps its KV-head's whole audio, whose kept mass is then
    # the full mass itself (recall 1.0 every step, and n·1.0 / n == 1.0)
    np.testing.assert_array_equal(run.per_head_recall[anchor_q], 1.0)
    assert (run.per_head_recall[~anchor_q] < 1.0).any()
