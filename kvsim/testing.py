"""The policy invariant checks, public: run them on your own policy from your own tests.

``check_policy(MyPolicy)`` (or ``check_policy("mypkg.mod:MyPolicy")``) replays the policy with
the real engine over small synthetic traces at several budgets, records its tiers after prefill
and after every decode step, and checks the protocol's rules from what was recorded,
independently of the engine's own checks (see :func:`check_run`). The kvsim test suite runs the
same checks on every registered policy (tests/test_policy_invariants.py, with random
hyperparameters; ``KVSIM_POLICY=mypkg.mod:MyPolicy`` adds yours to it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from kvsim.core.invariants import InvariantViolation
from kvsim.policies import TIER_CPU, TIER_GONE, TIER_GPU, Policy, registry
from kvsim.policies.spec import PolicySpec
from kvsim.replay.engine import ReplayConfig, Replayer, RunResult
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace.reader import Trace
from kvsim.trace.writer import write_trace

__all__ = ["InvariantViolation", "check_policy", "check_run", "replay_one"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantViolation(message)


@contextmanager
def captured_policies():
    """Record the policy objects the engine builds, to ask them for capacity / page budget."""
    made: list[Policy] = []

    def make(spec: PolicySpec) -> Policy:
        if spec.source is not None:
            registry.load(spec.source)
        pol = registry.make(spec.name, spec.budget, **spec.params)
        made.append(pol)
        return pol

    with mock.patch.object(PolicySpec, "make", make):
        yield made


def replay_one(spec: PolicySpec, audio_s: float, steps: int, seed: int,
               preset: str = "tiny") -> tuple[RunResult, Policy, Trace]:
    """Replay ``spec`` over a fresh synthetic trace with tiers recorded: (run, policy, trace)."""
    data = synthesize(SynthConfig(preset=preset, audio_seconds=audio_s, decode_steps=steps,
                                  seed=seed))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_trace(Path(tmp) / "t.kvtrace", data))
        with captured_policies() as made:
            rep = Replayer(trace, ReplayConfig(record_tiers=True, seed=seed))
            runs = rep.run([spec])
    if rep.failures:  # the policy refused this trace (PolicyNotApplicable): raised here
        raise rep.failures[0][1]
    return runs[0], made[0], trace


def _page_counts(mask: np.ndarray, page_size: int) -> np.ndarray:
    """Pages touched per (layer, KV-head) by a (L, H_kv, T_a) bool mask."""
    starts = np.arange(0, mask.shape[-1], page_size)
    return (np.add.reduceat(mask.astype(np.int64), starts, axis=-1) > 0).sum(axis=-1)


def _check_step(label: str, pol: Policy, run: RunResult, s: int) -> None:
    """Step ``s - 1``'s transition (tiers ``s - 1`` -> ``s``) against the rules and the log."""
    prev, cur = run.tiers[s - 1], run.tiers[s]
    gpu = cur == TIER_GPU
    _require(not ((prev == TIER_GONE) & (cur != TIER_GONE)).any(), f"{label}: GONE came back")
    came_up = (prev != TIER_GPU) & gpu
    _require(bool((prev[came_up] == TIER_CPU).all()),
             f"{label}: a position became GPU from GONE at step {s - 1}")
    _require(pol.recallable or not came_up.any(),
             f"{label}: not recallable but recalled at step {s - 1}")
    log = run.step_log
    _require(log["gpu_audio_tokens"][s - 1] == gpu.sum()
             and log["cpu_audio_tokens"][s - 1] == (cur == TIER_CPU).sum()
             and log["h2d_tokens"][s - 1] == ((prev == TIER_CPU) & gpu).sum(),
             f"{label}: the step log disagrees with the recorded tiers at step {s - 1}")
    # attention reads GPU positions only: before the step's update for decode_step policies,
    # after the per-layer select (which may recall) for query-aware ones
    readable = int(((cur if pol.query_aware else prev) == TIER_GPU).sum())
    read = int(log["read_audio_tokens"][s - 1])
    _require(read <= readable, f"{label}: read more than GPU at step {s - 1}")
    _require(pol.query_aware or read == readable,
             f"{label}: read {read} of {readable} GPU tokens at step {s - 1}")


def _check_pages(label: str, pol: Policy, run: RunResult) -> None:
    """Page-based policies (``page_budget`` and ``page_size``) keep to their page budget."""
    page_budget = getattr(pol, "page_budget", None)
    page_size = getattr(pol, "page_size", None)
    if page_budget is None or page_size is None:
        return
    n_layers, h_kv, t_a = run.tiers[0].shape
    if pol.saves_capacity:
        for cur in run.tiers:
            n = _page_counts(cur == TIER_GPU, page_size)
            _require(bool((n <= page_budget).all()),
                     f"{label}: {n.max()} pages > budget {page_budget}")
    else:  # everything resident: the page budget bounds what attention reads
        dense = min(int(getattr(pol, "dense_layers", 0)), n_layers)  # uncompressed layers
        bound = (n_layers - dense) * h_kv * page_budget * page_size + dense * h_kv * t_a
        _require(bool((run.step_log["read_audio_tokens"].to_numpy() <= bound).all()),
                 f"{label}: read more than its page budget")


def check_run(run: RunResult, pol: Policy) -> None:
    """Every protocol rule on one recorded run (``ReplayConfig(record_tiers=True)``).

    GONE is absorbing; a position becomes GPU only from CPU; a policy that is not
    ``recallable`` never recalls; the declared ``gpu_capacity`` holds at every step; the step
    log agrees with the tiers; attention reads only GPU positions; r_GPU <= r_GPU+CPU <= 1;
    page-based policies keep to their page budget. Raises :class:`InvariantViolation`.
    """
    label, tiers = run.spec.label, run.tiers
    _require(tiers is not None and len(tiers) == run.summary["steps"] + 1,
             f"{label}: tiers were not recorded after prefill and every step")
    shape = tiers[0].shape
    total = int(np.prod(shape))
    cap = pol.gpu_capacity()
    _require(cap is None or 0 <= cap <= total, f"{label}: capacity {cap} outside [0, {total}]")
    for s, cur in enumerate(tiers):
        _require(cur.dtype == np.uint8 and cur.shape == shape and cur.max(initial=0) <= TIER_GPU,
                 f"{label}: bad tier array at step {s - 1}")
        n_gpu = int((cur == TIER_GPU).sum())
        _require(cap is None or n_gpu <= cap, f"{label}: {n_gpu} GPU tokens > capacity {cap}")
        if s:
            _check_step(label, pol, run, s)
    summ = run.summary
    _require(0.0 <= summ["r_gpu"] <= summ["r_gpu_cpu"] + 1e-12 <= 1.0 + 1e-12
             and summ["r_gpu_max"] <= 1.0 + 1e-12
             and 0.0 <= summ["read_fraction"] <= 1.0 + 1e-12, f"{label}: r_GPU out of range")
    _require(bool(np.isfinite(summ["attn_recall"])) and -1e-9 <= summ["attn_recall"] <= 1 + 1e-9,
             f"{label}: attention recall {summ['attn_recall']} outside [0, 1]")
    _check_pages(label, pol, run)


def check_policy(policy: str | type[Policy], params: dict[str, Any] | None = None,
                 budgets: Iterable[float] = (0.1, 0.3, 0.6, 0.9),
                 presets: Iterable[str] = ("tiny", "small"), seeds: Iterable[int] = (0, 1),
                 audio_seconds: float = 8.0, steps: int = 6) -> list[RunResult]:
    """Replay ``policy`` (a class, a registered name or ``package.module:ClassName``) over
    small synthetic traces (every preset x seed) at every budget and :func:`check_run` each.

    Returns the runs (for further checks of your own); raises :class:`InvariantViolation`
    naming the run and the rule at the first violation.
    """
    if isinstance(policy, type):
        source, name = None, registry.admit(policy).name
    else:
        source = policy if ":" in policy else None
        name = registry.load(policy).name if source else registry.get(policy).name
    runs = []
    for preset in presets:
        for seed in seeds:
            for budget in budgets:
                spec = PolicySpec(name, budget, dict(params or {}), source)
                run, pol, _ = replay_one(spec, audio_seconds, steps, seed, preset)
                check_run(run, pol)
                runs.append(run)
    return runs
