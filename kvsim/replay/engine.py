"""The replay engine: drive policies over a recorded trace and measure what they keep.

For every decode step and layer the engine computes the full attention once,
``P = softmax(q Kᵀ/√d)``, and derives from it, for every policy and budget replayed in the
same run, the attention the compressed model would compute: softmax restricted to the
non-audio positions plus the GPU-resident audio of each KV-head, which is ``P`` masked and
renormalised (exactly equal, since softmax over a subset is the renormalised restriction).
So several policies cost one ``q·Kᵀ`` per step and layer plus cheap masked reductions.

Replay is open loop: the queries are those recorded under the full cache. Live mode
(closed loop) lives in :mod:`tracer`.

This module holds the public types and the :class:`Replayer` (prefill phase, then the step
loop, then one summary per run); the units it composes each have one job:

- :mod:`kvsim.replay.tensors` — the recorded tensors and the attention pass per (step, layer);
- :mod:`kvsim.replay.steploop` — the decode steps of all runs together;
- :mod:`kvsim.replay.selection` — query-aware ``select`` / ``select_layers``;
- :mod:`kvsim.replay.buffers` — the compressed attention handed to ``decode_step``;
- :mod:`kvsim.replay.metrics` — recall, top-K Jaccard and output error, batched over runs;
- :mod:`kvsim.replay.runstate` — one run's tiers and their update after each step;
- :mod:`kvsim.replay.logwriter` and :mod:`kvsim.replay.summary` — step log and summary;
- :mod:`kvsim.core.invariants` — the protocol checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from kvsim.core.attention import as_f32
from kvsim.core.invariants import InvariantViolation, check_capacity, check_tiers
from kvsim.core.steplog import RunFacts
from kvsim.core.views import WindowPrefillView
from kvsim.policies.base import HeadScores, Policy, PolicyContext, PolicyNotApplicable
from kvsim.policies.spec import PolicySpec
from kvsim.replay.logwriter import StepLogWriter
from kvsim.replay.metrics import RunMetrics
from kvsim.replay.padding import ReplayTrace, check_padding_mode, trace_for_replay
from kvsim.replay.runstate import PolicyRun
from kvsim.replay.steploop import LoopSettings, StepLoop
from kvsim.replay.summary import quality_summary, retention_summary, transfer_summary
from kvsim.replay.tensors import TraceTensors
from kvsim.trace.reader import Trace

__all__ = ["InvariantViolation", "PolicySpec", "ReplayConfig", "Replayer", "RunResult",
           "WindowPrefillView", "check_tiers", "replay_trace"]


@dataclass
class ReplayConfig:
    """How to replay.

    Parameters
    ----------
    topk : int
        K of the top-K Jaccard metric (clipped to T_a).
    error_stride : int
        Compute the attention-output error on every ``error_stride``-th step (needs values).
        It costs one ``P·V`` per policy, as much as the shared ``q·Kᵀ``, so by default it is
        sampled on every 16th step (an unbiased estimate of the per-step mean); 1 = every step.
    check_invariants : bool
        Check the protocol invariants at every step (cheap; on by default).
    record_tiers : bool
        Keep a copy of the tiers after prefill and after every step (small traces only).
    head_scores : HeadScores or None
        Calibration scores overriding those stored in the trace (``--calibration``).
    max_steps : int or None
        Replay only the first ``max_steps`` decode steps.
    seed : int
        Seed handed to policies (random control).
    padding : {"count", "drop"}
        Whether the encoder's padding counts as audio (``count``, the trace as recorded) or is
        taken out of the cache before any policy sees it (``drop``; needs a trace that
        records its padding). See :mod:`kvsim.replay.padding`.
    attention_block_mib : float
        Memory the shared attention pass may spend on decode steps computed ahead: the steps
        whose attention (every layer) fits are computed with one ``q·Kᵀ`` per layer, which
        reads the keys once for all of them (up to 16 steps; several times faster on short
        traces). 0 computes one step and layer at a time. The values may differ in the last
        bit between settings (see :func:`kvsim.core.attention.decode_attention_block`).
    """

    topk: int = 100
    error_stride: int = 16
    check_invariants: bool = True
    record_tiers: bool = False
    head_scores: HeadScores | None = None
    max_steps: int | None = None
    seed: int = 0
    padding: str = "count"
    attention_block_mib: float = 64.0

    def __post_init__(self) -> None:
        check_padding_mode(self.padding)
        if not self.attention_block_mib >= 0:  # NaN too
            raise ValueError(f"attention_block_mib must be >= 0, got {self.attention_block_mib}")


@dataclass
class RunResult:
    """Outcome of one (trace, policy, budget)."""

    trace: str
    spec: PolicySpec
    summary: dict[str, Any]
    step_log: pl.DataFrame
    facts: RunFacts
    per_head_recall: np.ndarray  #: (L, H_q) mean audio-mass recall over steps
    policy: Policy | None = None  #: the policy object after the run (for inspection)
    tiers: list[np.ndarray] | None = None
    #: (S,) attention recall of every decode step, mean over layers and q-heads
    step_recall: np.ndarray | None = None
    #: (L,) output error of every layer, mean over the sampled steps (NaN without values)
    layer_error: np.ndarray | None = None


# ----------------------------------------------------------------------------- views
class Replayer:
    """Replays several policy specs over one trace, sharing the attention computation.

    :meth:`run` is a prefill phase (every policy chooses its tiers from the prompt's
    attention), the decode steps of all runs together (:class:`kvsim.replay.steploop.StepLoop`)
    and one summary per run.
    """

    def __init__(self, trace: Trace, cfg: ReplayConfig | None = None) -> None:
        self.cfg = cfg or ReplayConfig()
        #: the trace as the replay reads it (padding taken out under ``padding="drop"``)
        self.trace: ReplayTrace = trace_for_replay(trace, self.cfg.padding)
        trace = self.trace
        meta = trace.meta
        self.heads = trace.head_layout
        self.audio = trace.audio_positions
        if len(self.audio) == 0:
            raise ValueError(f"{trace.path}: trace has no audio positions; nothing to compress")
        self.n_audio = len(self.audio)
        self.n_steps = meta.n_decode if self.cfg.max_steps is None else min(meta.n_decode, self.cfg.max_steps)
        self.tensors = TraceTensors.load(trace, int(self.cfg.attention_block_mib * 2**20))
        self.ctx = trace_context(trace, self.cfg.head_scores, self.cfg.seed)
        self.dtype_bytes = np.dtype(meta.model.dtype).itemsize
        #: (spec, why) of each policy that refused this trace; ``str(why)`` is the message
        self.failures: list[tuple[PolicySpec, PolicyNotApplicable]] = []

    def run(self, specs: list[PolicySpec]) -> list[RunResult]:
        """Replay every spec; a policy that cannot run on this trace as configured (no
        calibration, a budget that holds no page: :class:`PolicyNotApplicable`) is left out
        and reported in :attr:`failures`."""
        self.failures = []
        runs = self._prefill(specs)
        if not runs:
            return []
        prefill_r = [float(run.gpu.mean()) for run in runs]
        cfg = self.cfg
        settings = LoopSettings(n_steps=self.n_steps, n_audio=self.n_audio,
                                n_prefill=self.trace.meta.n_prefill, topk=cfg.topk,
                                error_stride=cfg.error_stride,
                                check_invariants=cfg.check_invariants)
        metrics = StepLoop(self.tensors, runs, self.heads, settings).run()
        return [self._result(run, r0, m) for run, r0, m in zip(runs, prefill_r, metrics, strict=True)]

    def _prefill(self, specs: list[PolicySpec]) -> list[PolicyRun]:
        """Prefill phase: every policy's tiers after the prompt, checked; the runs whose
        policy could prefill."""
        shape = (self.heads.n_layers, self.heads.n_kv_heads, self.n_audio)
        runs = [PolicyRun(s, s.make(), StepLogWriter(self.heads, self.n_audio, self.n_steps,
                                                     self.dtype_bytes)) for s in specs]
        view = self._prefill_view()
        prefilled = []
        for run in runs:
            try:
                tiers = run.timed(run.policy.prefill, self.ctx, view)
            except PolicyNotApplicable as exc:
                # a policy that cannot run on this trace is reported; the others go on
                self.failures.append((run.spec, exc))
                continue
            check_tiers(run.label, tiers, shape)
            run.set_tiers(tiers)
            if self.cfg.check_invariants:
                check_capacity(run.label, run.policy, run.n_gpu, -1)
            if self.cfg.record_tiers:
                run.history = [tiers.copy()]
            prefilled.append(run)
        return prefilled

    def _prefill_view(self) -> WindowPrefillView:
        """The observation window's attention over the audio, shared by every policy."""
        window = self.trace.window_positions
        rows = np.array([self.trace.query_index(int(p)) for p in window], dtype=np.int64)
        return WindowPrefillView(lambda layer: as_f32(self.trace.queries(layer)[:, rows]),
                                 self.tensors.keys, window, self.audio)

    def _result(self, run: PolicyRun, prefill_r: float, metrics: RunMetrics) -> RunResult:
        """The end-of-run summary, step log and facts of one run."""
        log = run.log.frame(self.trace.meta.n_prefill)
        spec = run.spec
        summary = {
            "trace": self.trace.name,
            "policy": spec.name,
            "label": spec.label,
            "budget": spec.budget,
            "steps": self.n_steps,
            "padding": self.cfg.padding,
            "n_audio": self.n_audio,
            **retention_summary(log, self.ctx.audio_kv_total, prefill_r),
            "saves_capacity": run.policy.saves_capacity,
            **quality_summary(metrics, self.n_steps, self.heads.n_layers),
            **transfer_summary(log),
            "policy_seconds": run.seconds,
        }
        return RunResult(
            trace=self.trace.name, spec=spec, summary=summary, step_log=log,
            facts=self._facts(spec), per_head_recall=metrics.recall_sum / max(self.n_steps, 1),
            policy=run.policy, tiers=run.history,
            step_recall=metrics.step_recall / self.heads.n_layers,
            layer_error=_layer_error(metrics, self.heads.n_layers),
        )

    def _facts(self, spec: PolicySpec) -> RunFacts:
        meta, heads = self.trace.meta, self.heads
        return RunFacts(
            model=meta.model.name, n_layers=heads.n_layers, n_q_heads=heads.n_q_heads,
            n_kv_heads=heads.n_kv_heads, head_dim=heads.head_dim,
            dtype_bytes=self.dtype_bytes, n_audio=self.n_audio,
            n_prefill=meta.n_prefill, n_decode=self.n_steps,
            policy=spec.label, budget=spec.budget,
            audio_tokens_per_s=meta.model.audio_tokens_per_s,
        )


def trace_context(trace: Trace | ReplayTrace, head_scores: HeadScores | None = None,
                  seed: int = 0) -> PolicyContext:
    """The policy context of ``trace`` as replay hands it to every policy: its head layout,
    audio span and prompt length, and ``head_scores`` (a calibration file's) or else the
    trace's own."""
    meta = trace.meta
    return PolicyContext(
        heads=trace.head_layout, n_audio=len(trace.audio_positions),
        audio_tokens_per_s=meta.model.audio_tokens_per_s, n_prefill=meta.n_prefill,
        head_scores=head_scores if head_scores is not None else trace.head_scores, seed=seed)


def _layer_error(metrics: RunMetrics, n_layers: int) -> np.ndarray:
    """(L,) mean output error of every layer over the sampled steps (NaN when none was)."""
    steps = metrics.err_n // n_layers
    if not steps or metrics.err_by_layer is None:
        return np.full(n_layers, np.nan)
    return metrics.err_by_layer / steps


def replay_trace(trace: Trace, specs: list[PolicySpec], cfg: ReplayConfig | None = None) -> list[RunResult]:
    """Replay ``specs`` over ``trace`` in one pass; see :class:`Replayer`."""
    return Replayer(trace, cfg).run(specs)
