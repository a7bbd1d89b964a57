"""The decode-step program run on the SimPy hardware model.

One simulation runs ``n_steps`` decode steps of a batch of identical sequences, composed of
one unit per job:

- the **host thread** (a SimPy process, :class:`kvsim.sim.host.HostThread`) launches each layer's kernels (eager: operators x
  (dispatcher cost + launch); CUDA graphs: one graph launch per step), pays the API cost of
  every recall copy, reads the sampled token back (a stream synchronisation) and pays the
  generate loop's per-step overhead;
- the **compute stream** runs each layer for ``max(HBM bytes / bandwidth, FLOPs / peak,
  kernels x minimum kernel time)``;
- recalls (CPU->GPU copies over the H2D channel of the PCIe link) run either synchronously on
  the host (``recall='sync'``: what the WnW paper did — the host blocks on every copy) or on a
  separate **copy stream** (``recall='overlap'``: compute waits on a per-layer event only where
  it reads the recalled KV), issued by :class:`kvsim.sim.recalls.RecallIssuer`;
- the **HBM ledger** (:class:`kvsim.sim.memory.DecodeMemory`) tracks weights, resident KV,
  staging buffers and workspace.

Recall timing follows the replay engine: tier changes decided at decode step s (a row of the
step log) take effect from step s+1, so their copies are issued at the end of step s.
Query-aware policies (ArkVale, Quest) recall inside the step, before the layer that reads the
positions (``recall_timing='in_layer'``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import simpy

from kvsim.sim.hardware import HbmLedger, PcieLink, Stream
from kvsim.sim.host import HostThread
from kvsim.sim.memory import DecodeMemory
from kvsim.sim.presets import GpuPreset, ModelPreset, RuntimePreset
from kvsim.sim.recalls import RecallIssuer, RecallPlan
from kvsim.sim.workload import StepWorkload

Recall = Literal["sync", "overlap"]
Granularity = Literal["run", "segment", "layer"]
_IN_LAYER_POLICIES = {"arkvale", "quest"}


class ModeError(ValueError):
    """An unknown simulation mode string (one-line message)."""


@dataclass(frozen=True)
class SimMode:
    """How recalls are issued.

    Attributes
    ----------
    recall
        ``'sync'``: the host blocks on each copy after the step (naive, WnW paper §3.9);
        ``'overlap'``: copies go on a copy stream and compute waits on per-layer events
        (the optimisation the paper's Limitations propose).
    granularity
        Copies per recall: ``'run'`` one ``cudaMemcpyAsync`` per contiguous run of
        positions; ``'segment'`` one gathered copy per (head, segment) piece (CPU gather +
        GPU scatter kernel); ``'layer'`` one gathered copy per layer (fully coalesced).
    pinned
        Host buffers pinned (full PCIe rate) or pageable (staged by the driver).
    cuda_graphs
        Replace per-kernel launches by one graph launch per step.
    recall_timing
        ``'after_step'``, ``'in_layer'`` or ``'auto'`` (in-layer for ArkVale/Quest).
    """

    recall: Recall = "sync"
    granularity: Granularity = "segment"
    pinned: bool = False
    cuda_graphs: bool = False
    recall_timing: Literal["auto", "after_step", "in_layer"] = "auto"

    NAMED = ("sync", "overlap", "coalesced", "sync-run", "overlap-run")

    @classmethod
    def parse(cls, spec: str | SimMode) -> SimMode:
        """``'sync'``, ``'overlap'``, ``'coalesced'``, ``'sync-run'``, ``'overlap-run'``,
        optionally followed by ``+graphs``, or ``key=value`` pairs joined by commas
        (``recall=overlap,granularity=run,pinned=true,cuda_graphs=true``)."""
        if isinstance(spec, SimMode):
            return spec
        text = spec.strip().lower()
        graphs = text.endswith("+graphs")
        text = text.removesuffix("+graphs")
        named = {
            "sync": cls("sync", "segment", False),
            "overlap": cls("overlap", "segment", True),
            "coalesced": cls("overlap", "layer", True),
            "sync-run": cls("sync", "run", False),
            "overlap-run": cls("overlap", "run", True),
        }
        if text in named:
            return replace(named[text], cuda_graphs=graphs)
        if "=" not in text:
            raise ModeError(f"unknown mode {spec!r}; use one of {', '.join(cls.NAMED)} or key=value")
        kw: dict[str, object] = {}
        for part in text.split(","):
            key, _, val = part.partition("=")
            key = key.strip()
            val = val.strip()
            if key in ("pinned", "cuda_graphs", "graphs"):
                if val not in ("true", "false", "1", "0", "yes", "no"):
                    raise ModeError(f"mode {spec!r}: {key} must be true/false")
                kw["cuda_graphs" if key == "graphs" else key] = val in ("true", "1", "yes")
            elif key == "recall" and val in ("sync", "overlap") or key == "granularity" and val in ("run", "segment", "layer") or key == "recall_timing" and val in ("auto", "after_step", "in_layer"):
                kw[key] = val
            else:
                raise ModeError(f"mode {spec!r}: bad setting {part!r}")
        if "pinned" not in kw:
            kw["pinned"] = kw.get("recall", "sync") == "overlap"
        mode = replace(cls(), **kw)
        return replace(mode, cuda_graphs=True) if graphs else mode


@dataclass(frozen=True)
class StepCosts:
    """Per-layer costs that do not depend on the step (derived from presets and batch)."""

    host_layer_us: float
    host_head_us: float
    host_step_fixed_us: float
    graph_launch_us: float
    gpu_head_us: float
    layer_weight_us: float
    layer_flops_us: float
    layer_min_us: float
    kv_read_us_per_byte: float
    stream_us_per_byte: float


def step_costs(gpu: GpuPreset, model: ModelPreset, rt: RuntimePreset, batch: int,
               cuda_graphs: bool) -> StepCosts:
    """Constant costs of a decode step (see docs/simulator.md)."""
    stream_bw = gpu.hbm_bandwidth_gbps * gpu.hbm_efficiency * 1e3  # B/us
    kv_bw = gpu.hbm_bandwidth_gbps * gpu.kv_read_efficiency * 1e3
    flops_us = gpu.peak_tflops * gpu.flops_efficiency * 1e6  # FLOP/us
    per_op = rt.host_us_per_op
    layer_host = rt.ops_per_layer * per_op + rt.kernels_per_layer * gpu.kernel_launch_us
    head_host = rt.step_ops * per_op + max(rt.step_ops / 2, 1) * gpu.kernel_launch_us
    layer_params = model.layer_weight_bytes / model.dtype_bytes
    return StepCosts(
        host_layer_us=0.0 if cuda_graphs else layer_host,
        host_head_us=0.0 if cuda_graphs else head_host,
        host_step_fixed_us=rt.step_fixed_us,
        graph_launch_us=gpu.graph_launch_us if cuda_graphs else 0.0,
        gpu_head_us=max(model.lm_head_bytes / stream_bw,
                        2 * batch * model.vocab_size * model.hidden_size / flops_us,
                        gpu.min_kernel_us * 4),
        layer_weight_us=model.layer_weight_bytes / stream_bw,
        layer_flops_us=2 * batch * layer_params / flops_us,
        layer_min_us=rt.kernels_per_layer * gpu.min_kernel_us,
        kv_read_us_per_byte=1.0 / kv_bw,
        stream_us_per_byte=1.0 / stream_bw,
    )


@dataclass
class RawResult:
    """Per-step arrays produced by :func:`run_simulation` (times in microseconds)."""

    step_us: np.ndarray
    host_copy_us: np.ndarray
    compute_stall_us: np.ndarray
    gpu_bytes: np.ndarray
    h2d_bytes: np.ndarray
    n_copies: np.ndarray
    cpu_bytes: np.ndarray  # host bytes of positions held only on CPU (whole batch)
    high_water: int
    events: int
    ledger_by_tag: dict[str, int]


def run_simulation(
    wl: StepWorkload,
    gpu: GpuPreset,
    model: ModelPreset,
    rt: RuntimePreset,
    mode: SimMode,
    batch: int = 1,
    strict_memory: bool = False,
) -> RawResult:
    """Simulate ``wl.n_steps`` decode steps of ``batch`` identical sequences."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    env = simpy.Environment()
    link = PcieLink(env)
    compute = Stream(env, "compute")
    copy = Stream(env, "copy")
    ledger = HbmLedger(gpu.usable_bytes, strict=strict_memory)
    costs = step_costs(gpu, model, rt, batch, mode.cuda_graphs or rt.cuda_graphs)
    plan = RecallPlan.build(wl, gpu, rt, mode, batch)
    resident_layer, layer_us = layer_times(wl, gpu, model, rt, costs, batch)
    memory = DecodeMemory(ledger, model, batch, rt.cache_copy_factor)
    recalls = RecallIssuer(env, plan, link, copy, compute, memory, wl.n_steps,
                           blocking=mode.recall == "sync")
    host = HostThread(env, costs, compute, recalls, memory, layer_us, resident_layer,
                      wl.n_layers, in_layer=recalls_in_layer(mode, wl.facts.policy))
    env.process(host.run())
    env.run()
    return RawResult(
        step_us=host.step_us,
        host_copy_us=recalls.host_copy_us,
        compute_stall_us=_stall_per_step(compute, wl.n_steps),
        gpu_bytes=host.gpu_bytes,
        h2d_bytes=plan.nbytes.sum(axis=1).astype(np.int64),
        n_copies=plan.n_copies.sum(axis=1).astype(np.int64),
        cpu_bytes=(np.zeros(wl.n_steps, dtype=np.int64) if wl.cpu_audio_tokens is None
                   else wl.cpu_audio_tokens.astype(np.int64) * wl.facts.kv_bytes_per_head_token
                   * batch),
        high_water=ledger.high_water,
        events=next(env._eid),  # SimPy's running event counter
        ledger_by_tag=dict(ledger.by_tag),
    )


def recalls_in_layer(mode: SimMode, policy: str) -> bool:
    """Whether the recalls decided at a step are issued inside it, before the layer that
    reads them (query-aware policies), rather than at its end."""
    timing = mode.recall_timing
    if timing == "auto":
        base = policy.lower().split(":")[0].split("@")[0]
        timing = "in_layer" if base in _IN_LAYER_POLICIES else "after_step"
    return timing == "in_layer"


def layer_times(wl: StepWorkload, gpu: GpuPreset, model: ModelPreset, rt: RuntimePreset,
                c: StepCosts, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step: resident KV bytes of one layer (whole batch) and the compute-stream time of
    one layer, ``max(HBM bytes / bandwidth, FLOPs / peak, kernels x minimum kernel time)``."""
    facts, n_layers = wl.facts, wl.n_layers
    kvb = facts.kv_bytes_per_head_token
    non_audio = wl.non_audio_tokens.astype(np.float64)
    resident_layer = batch * (non_audio * facts.n_kv_heads + wl.gpu_audio_tokens / n_layers) * kvb
    read_layer = batch * (non_audio * facts.n_kv_heads + wl.read_audio_tokens / n_layers) * kvb
    layer_mem_us = (
        c.layer_weight_us
        + read_layer * c.kv_read_us_per_byte
        + rt.cache_copy_factor * resident_layer * c.stream_us_per_byte
    )
    attn_flops_us = 4.0 * read_layer / kvb * model.head_dim * (model.n_q_heads / model.n_kv_heads)
    attn_flops_us /= gpu.peak_tflops * gpu.flops_efficiency * 1e6
    layer_us = np.maximum(np.maximum(layer_mem_us, c.layer_flops_us + attn_flops_us), c.layer_min_us)
    return resident_layer, layer_us


def _stall_per_step(compute: Stream, n_steps: int) -> np.ndarray:
    """Time the compute stream waited on copy events, per step."""
    stall = np.zeros(n_steps)
    for k, v in compute.stall_us.items():
        if 0 <= k < n_steps:
            stall[k] += v
    return stall
