"""Property tests of the policy protocol's invariants (docs/design.md) for EVERY registered policy.

Each policy found by ``policies.available()`` (so policies added later are covered without
editing this file) is replayed by the real engine over random tiny synthetic traces, at random
budgets and with random hyperparameters drawn around its defaults, with the tiers recorded
after prefill and after every decode step. The checks (``kvsim.testing.check_run``, public so
that a user runs them from their own tests) are made from the recorded tiers and step log,
independently of the engine's own checks:

* GONE is absorbing; a position becomes GPU only from CPU (never from GONE); a policy that is
  not ``recallable`` never moves CPU -> GPU;
* the GPU capacity the policy declares holds at every step, not only on average;
* r_GPU <= r_GPU+CPU <= 1, per step and in the summary;
* attention reads only GPU positions (step log ``read_audio_tokens``);
* page-based policies (a ``page_budget`` and ``page_size``) never hold (or read, when they keep
  everything resident) more than their page budget per (layer, KV-head);
* policies that need calibration scores get them from the synthetic trace (none is dropped);
* ``full`` reproduces full attention exactly: recall 1, output error 0;
* policies whose tiers never change after prefill hit the target r_GPU within 0.01;
* recallable policies do recall (on a "small" trace whose decode attention sweeps the audio).

A user's policy outside kvsim joins the suite by module path (docs/adding-a-policy.md):
``KVSIM_POLICY=mypkg.mod:MyPolicy pytest tests/test_policy_invariants.py -k my_policy``.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from kvsim.policies import MissingCalibrationError, PolicyNotApplicable, Tier, available, registry
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
from kvsim.synth import SynthConfig, synthesize
from kvsim.testing import captured_policies, replay_one
from kvsim.testing import check_run as check_invariants
from kvsim.trace.reader import Trace
from kvsim.trace.writer import write_trace

#: user policies (``package.module:ClassName``, comma-separated) to check with the shipped ones
USER_POLICIES = [registry.load(p.strip()).name
                 for p in os.environ.get("KVSIM_POLICY", "").split(",") if p.strip()]
POLICIES = sorted(available())


# ----------------------------------------------------------------------------- helpers
#: known choices of string hyperparameters, by field name (a policy that refuses one of them
#: with a ValueError just rejects that example)
STRING_CHOICES: dict[str, list[str]] = {
    "group_reduce": ["max", "mean", "sum"],
    "budget_unit": ["tokens", "pages"],
    "pooling": ["avg", "max"],
    "budget_mode": ["paper", "step"],
    "prefill_selection": ["segment", "global"],
    "triage_signal": ["vs_hs", "vs", "hs"],
    "scoring": ["head", "layer"],
}


def _param_strategy(default: Any, name: str = "") -> st.SearchStrategy:
    """Values around a hyperparameter's default, by type; unknown types keep the default."""
    if isinstance(default, str) and name in STRING_CHOICES:
        return st.sampled_from(STRING_CHOICES[name])
    if isinstance(default, bool):
        other = st.booleans()
    elif isinstance(default, int):
        other = (
            st.integers(0, 4) if default <= 0 else st.integers(max(1, default // 4), 2 * default)
        )
    elif isinstance(default, float):
        if 0.0 < default <= 1.0:
            other = st.floats(default / 2, min(1.0, default * 1.5), allow_nan=False)
        else:
            other = st.floats(default / 2, default * 2, allow_nan=False)
    else:
        return st.just(default)
    return st.one_of(st.just(default), other)


@st.composite
def hyperparameters(draw: st.DrawFn, name: str) -> dict[str, Any]:
    return {k: draw(_param_strategy(v, k)) for k, v in registry.get(name).hyperparameters().items()}


# ----------------------------------------------------------------------------- properties
RECALLABLE = [n for n, c in available().items() if c.recallable]
_SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _draw_and_check(name: str, data: st.DataObject, recall_path: bool) -> bool:
    """Draw one configuration of ``name``, replay it, check the invariants; True when it
    recalled. ``recall_path`` steers the draw to where recall can happen: a tight budget, a
    longer trace that sweeps the audio (the "small" preset), enough decode steps."""
    if recall_path:
        budget = data.draw(st.floats(0.15, 0.5), label="budget")
        audio_s = data.draw(st.floats(8.0, 20.0), label="audio_s")
        steps = data.draw(st.integers(6, 12), label="steps")
        preset = "small"
    else:
        budget = data.draw(st.floats(0.05, 1.0), label="budget")
        audio_s = data.draw(st.floats(1.0, 10.0), label="audio_s")
        steps = data.draw(st.integers(1, 8), label="steps")
        preset = data.draw(st.sampled_from(["tiny", "small"]), label="preset")  # 4 or 8 KV-heads
    params = data.draw(hyperparameters(name), label="params")
    if recall_path and name == "wnw":  # the paper's 5 anchors do not fit 8 KV-heads at r < 0.6
        params["n_anchor"] = data.draw(st.integers(1, 2), label="n_anchor")
        params["n_voice"] = params["n_anchor"] + data.draw(st.integers(2, 6), label="n_tidal")
    if recall_path and name == "arkvale":  # pages small enough that free slots remain
        params["page_size"] = data.draw(st.integers(4, 16), label="page_size")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    spec = PolicySpec(name, budget, params)
    try:
        spec.make()
        run, pol, _ = replay_one(spec, audio_s, steps, seed, preset)
    except MissingCalibrationError:  # synthetic traces carry head scores: a real failure
        raise
    except (ValueError, PolicyNotApplicable) as exc:  # invalid or infeasible: a clear error
        note(f"rejected: {exc}")
        assume(False)
    check_invariants(run, pol)
    return int(run.step_log["h2d_tokens"].sum()) > 0


@pytest.mark.parametrize("name", [n for n in POLICIES if n not in RECALLABLE])
@_SETTINGS
@given(data=st.data())
def test_invariants_hold_for_every_policy(name: str, data: st.DataObject) -> None:
    _draw_and_check(name, data, recall_path=False)


@pytest.mark.parametrize("name", RECALLABLE)
def test_invariants_of_recallable_policies_reach_the_recall_path(name: str) -> None:
    """The invariants of recallable policies on draws steered to the recall path, and most
    draws do recall (before steering: WnW 2 of 20, ArkVale 0 of 20)."""
    recalled: list[bool] = []

    # derandomized: the share is a property of these 20 draws, the same on every run and
    # machine (a random set of 20 would make the threshold a coin toss)
    @settings(_SETTINGS, derandomize=True, database=None)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        recalled.append(_draw_and_check(name, data, recall_path=True))

    check()
    print(f"{name}: {sum(recalled)} of {len(recalled)} draws recall")
    share = float(np.mean(recalled))
    assert len(recalled) >= 10 and share >= 0.6, f"{name}: {share:.2f} of {len(recalled)} recall"


@pytest.mark.parametrize("name", [n for n, c in available().items() if c.recallable])
def test_recallable_policies_do_recall(name: str) -> None:
    """The recall invariants are not vacuous: on a trace whose decode attention sweeps through
    the audio (synthetic frontier heads), every recallable policy moves some CPU KV to GPU."""
    recalled = 0
    for budget in (0.2, 0.4):
        # "small" has 8 KV-heads: WnW's paper default of 5 anchors does not fit r = 0.2
        params = {"n_anchor": 1} if name == "wnw" else {}
        run, pol, _ = replay_one(PolicySpec(name, budget, params), 30.0, 20, 4,
                                     preset="small")
        check_invariants(run, pol)
        n = int(run.step_log["h2d_tokens"].sum())
        if n:
            assert run.summary["r_gpu_cpu"] > run.summary["r_gpu"]  # recalled from a CPU copy
        recalled += n
    assert recalled > 0, f"{name} is recallable but never recalled at r_GPU 0.2 or 0.4"


@pytest.mark.parametrize("name", POLICIES)
def test_defaults_run_at_paper_budgets(name: str) -> None:
    """Every policy runs with its defaults at the four WnW budgets on one shared trace."""
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=12, decode_steps=6, seed=3))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        for budget in (0.2, 0.4, 0.6, 0.8):
            with captured_policies() as made:
                runs = replay_trace(
                    trace, [PolicySpec(name, budget)], ReplayConfig(record_tiers=True)
                )
            assert len(runs) == 1, f"{name} was dropped (missing calibration?)"
            check_invariants(runs[0], made[0])


def test_full_reproduces_full_attention_exactly() -> None:
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=6, decode_steps=5, seed=1))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        (run,) = replay_trace(trace, [PolicySpec("full", 0.3)], ReplayConfig(record_tiers=True))
    assert run.summary["attn_recall"] == 1.0
    assert run.summary["attn_recall_min_step"] == 1.0
    assert run.summary["output_error"] == 0.0
    assert run.summary["r_gpu"] == run.summary["r_gpu_cpu"] == 1.0
    assert all((t == Tier.GPU).all() for t in run.tiers)


@pytest.mark.parametrize("name", [n for n in POLICIES if n not in RECALLABLE])
def test_static_policies_hit_target_budget(name: str) -> None:
    """A policy whose tiers never change after prefill must keep r_GPU within 0.01 of target
    (checked on a 30 s trace, T_a = 375, where one token per head is 0.0027)."""
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=30, decode_steps=3, seed=2))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        specs = [PolicySpec(name, b) for b in (0.2, 0.4, 0.6, 0.8)]
        with captured_policies() as made:
            runs = replay_trace(trace, specs, ReplayConfig(record_tiers=True))
    for run, pol in zip(runs, made, strict=True):
        static = all(np.array_equal(run.tiers[0], t) for t in run.tiers[1:])
        if not static or not pol.saves_capacity or pol.recallable or name == "full":
            continue
        r = run.spec.budget
        assert math.isclose(run.summary["r_gpu"], r, abs_tol=0.01), (
            f"{name}: measured r_GPU {run.summary['r_gpu']:.4f} at target {r}"
        )
