"""Hardware simulator: a SimPy model of the host thread, CUDA streams, HBM and PCIe.

Public API (used by ``kvsim replay --simulate`` and ``kvsim simulate``)::

    simulate_run(step_log, facts, gpu="h100-sxm", mode="sync", *, model=None,
                 runtime="hf-sdpa", batch=1) -> SimResult
    SimResult.summary() -> dict ; SimResult.per_step -> pl.DataFrame

See docs/simulator.md.
"""

from __future__ import annotations

import time

import polars as pl

from kvsim.core.steplog import RunFacts
from kvsim.sim.analytic import AnalyticError, AnalyticPolicy, analytic_workload, decode_steps_for
from kvsim.sim.engine import ModeError, SimMode, run_simulation
from kvsim.sim.hardware import HbmLedger, HbmOutOfMemory, PcieLink, Stream, transfer_us
from kvsim.sim.presets import (
    GpuPreset,
    ModelPreset,
    PresetError,
    RuntimePreset,
    gpu_preset,
    list_presets,
    load_preset,
    model_preset,
    runtime_preset,
)
from kvsim.sim.result import SimResult
from kvsim.sim.workload import StepWorkload, WorkloadError, facts_from_json, from_step_log

DEFAULT_RUNTIME = "hf-sdpa"

__all__ = [
    "AnalyticError", "AnalyticPolicy", "GpuPreset", "HbmLedger", "HbmOutOfMemory", "ModeError",
    "ModelPreset", "PcieLink", "PresetError", "RuntimePreset", "SimMode", "SimResult",
    "StepWorkload", "Stream", "WorkloadError", "analytic_workload", "decode_steps_for", "facts_from_json",
    "from_step_log", "gpu_preset", "list_presets", "load_preset", "max_batch", "model_preset",
    "preset_for", "runtime_preset", "simulate_run", "simulate_runs", "simulate_workload", "transfer_us",
]


def _check_facts(facts: RunFacts, model: ModelPreset) -> None:
    for attr in ("n_layers", "n_kv_heads", "head_dim"):
        if getattr(facts, attr) != getattr(model, attr):
            raise PresetError(
                f"run facts {attr}={getattr(facts, attr)} do not match model preset "
                f"{model.name!r} ({attr}={getattr(model, attr)}); pass model= explicitly"
            )


def preset_for(name: str, layout: object) -> ModelPreset:
    """The model preset ``name``, checked against the ``n_layers``, ``n_kv_heads`` and
    ``head_dim`` of ``layout`` (a trace's ``meta.model``, a RunFacts). Raises
    :class:`PresetError` (one line) for an unknown model or another layout, so that a caller
    can refuse a run before replaying it."""
    preset = model_preset(name)
    _check_facts(layout, preset)
    return preset


def simulate_workload(
    wl: StepWorkload,
    gpu: str | GpuPreset = "h100-sxm",
    mode: SimMode | str = "sync",
    *,
    model: str | ModelPreset | None = None,
    runtime: str | RuntimePreset = DEFAULT_RUNTIME,
    batch: int = 1,
    strict_memory: bool = False,
) -> SimResult:
    """Simulate a :class:`StepWorkload` (from a step log or :func:`analytic_workload`)."""
    g = gpu_preset(gpu)
    m = model_preset(model if model is not None else wl.facts.model)
    _check_facts(wl.facts, m)
    rt = runtime_preset(runtime)
    md = SimMode.parse(mode)
    t0 = time.perf_counter()
    raw = run_simulation(wl, g, m, rt, md, batch=batch, strict_memory=strict_memory)
    return SimResult(raw=raw, gpu=g.name, model=m.name, runtime=rt.name, mode=md, batch=batch,
                     sim_wall_s=time.perf_counter() - t0)


def simulate_run(
    step_log: pl.DataFrame,
    facts: RunFacts,
    gpu: str | GpuPreset = "h100-sxm",
    mode: SimMode | str = "sync",
    *,
    model: str | ModelPreset | None = None,
    runtime: str | RuntimePreset = DEFAULT_RUNTIME,
    batch: int = 1,
) -> SimResult:
    """Simulate a replay's step log on a GPU preset.

    Parameters
    ----------
    step_log, facts
        A replay's per-step log (columns of :mod:`kvsim.core.steplog`) and its RunFacts.
    gpu
        GPU preset name (``a100-80gb``, ``h100-sxm``, ``h200``), a ``.toml`` path, or a preset.
    mode
        ``'sync'`` | ``'overlap'`` | ``'coalesced'`` | ``'sync-run'`` | ``'overlap-run'``
        (``+graphs`` for CUDA graphs) or a :class:`SimMode`.
    model
        Model preset; default: looked up from ``facts.model`` (aliases accepted).
    runtime
        Host runtime preset (``hf-sdpa``, ``hf-eager``).
    batch
        Identical sequences decoded together.
    """
    m = model_preset(model if model is not None else facts.model)
    _check_facts(facts, m)
    wl = from_step_log(step_log, facts)
    return simulate_workload(wl, gpu, mode, model=m, runtime=runtime, batch=batch)


def simulate_runs(
    runs: list,
    gpu: str | GpuPreset = "h100-sxm",
    modes: tuple[str, ...] = ("sync",),
    *,
    runtime: str | RuntimePreset = DEFAULT_RUNTIME,
    batch: int = 1,
) -> pl.DataFrame:
    """Summaries for replay results (objects with ``.step_log`` and ``.facts``, e.g. the
    engine's ``RunResult``), one row per (run, mode), keyed by trace / policy label / budget."""
    rows = []
    for run in runs:
        facts = run.facts
        for mode in modes:
            res = simulate_run(run.step_log, facts, gpu, mode, runtime=runtime, batch=batch)
            rows.append({"trace": getattr(run, "trace", ""), "policy": facts.policy,
                         "budget": facts.budget, "sim_mode": mode, **res.summary()})
    return pl.DataFrame(rows)


def max_batch(
    wl: StepWorkload,
    gpu: str | GpuPreset,
    mode: SimMode | str = "sync",
    *,
    model: str | ModelPreset | None = None,
    runtime: str | RuntimePreset = DEFAULT_RUNTIME,
    capacity_gib: float | None = None,
) -> int:
    """Largest batch whose HBM high-water mark fits the GPU (or ``capacity_gib``).

    Every ledger entry but the weights scales with the batch, so the batch-1 high-water mark
    gives the per-sequence bytes; the caller can confirm with ``strict_memory=True``.
    """
    g = gpu_preset(gpu)
    one = simulate_workload(wl, g, mode, model=model, runtime=runtime, batch=1)
    m = model_preset(model if model is not None else wl.facts.model)
    usable = g.usable_bytes if capacity_gib is None else int((capacity_gib - g.reserved_gib) * 2**30)
    per_seq = one.raw.high_water - m.weight_bytes
    free = usable - m.weight_bytes
    if per_seq <= 0 or free < per_seq:
        return 0
    return int(free // per_seq)
