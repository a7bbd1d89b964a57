"""CPU→GPU recall copies of the decode program: how many copies of how many bytes each
(step, layer) needs, and the copy-stream unit that issues them from the host.

A copy costs the host its API call (plus, gathered, the CPU gather of its bytes and the launch
of the GPU scatter kernel) and holds the H2D channel of the PCIe link for ``alpha + B/beta``.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import simpy

from kvsim.sim.hardware import PcieLink, Stream, transfer_us
from kvsim.sim.memory import DecodeMemory
from kvsim.sim.presets import GpuPreset, RuntimePreset
from kvsim.sim.workload import StepWorkload

if TYPE_CHECKING:
    from kvsim.sim.engine import SimMode


@dataclass(frozen=True)
class RecallPlan:
    """Recall copies per (step, layer) for the whole batch, and what one copy costs.

    Attributes
    ----------
    n_copies, nbytes : (S, L) arrays
        Copies and bytes recalled at every step and layer.
    gathered : bool
        Copies gather scattered positions into a staging buffer (a GPU scatter kernel each).
    h2d_gbps, latency_us : float
        Bandwidth (GB/s) and per-copy latency (alpha) of the H2D channel.
    host_per_copy_us : float
        Host cost of issuing one copy (dispatcher ops + ``cudaMemcpyAsync`` [+ scatter launch]).
    gather_us_per_byte : float
        Host cost of gathering one byte into a staging buffer (0 without gathering).
    scatter_kernel_us : float
        GPU time of one scatter kernel on the compute stream.
    """

    n_copies: np.ndarray
    nbytes: np.ndarray
    gathered: bool
    h2d_gbps: float
    latency_us: float
    host_per_copy_us: float
    gather_us_per_byte: float
    scatter_kernel_us: float

    @classmethod
    def build(cls, wl: StepWorkload, gpu: GpuPreset, rt: RuntimePreset, mode: SimMode,
              batch: int) -> RecallPlan:
        """Copies per (step, layer) of ``wl`` scaled to ``batch``, at ``mode``'s granularity."""
        nbytes = wl.h2d_tokens_by_layer * batch * wl.facts.kv_bytes_per_head_token
        if mode.granularity == "run":
            n_copies = wl.h2d_runs_by_layer * batch
        elif mode.granularity == "segment":
            n_copies = wl.h2d_segments_by_layer * batch
        else:
            n_copies = (wl.h2d_tokens_by_layer > 0).astype(np.int64)
        gathered = mode.granularity != "run"
        # with CUDA graphs the recall copies are still issued eagerly from Python: same cost
        return cls(
            n_copies=n_copies, nbytes=nbytes, gathered=gathered,
            h2d_gbps=gpu.pcie_h2d_pinned_gbps if mode.pinned else gpu.pcie_h2d_pageable_gbps,
            latency_us=gpu.pcie_latency_us + (0.0 if mode.pinned else gpu.pageable_extra_us),
            host_per_copy_us=gpu.memcpy_api_us + (
                3 * rt.host_us_per_op + gpu.kernel_launch_us if gathered else 2 * rt.host_us_per_op),
            gather_us_per_byte=1.0 / (rt.host_gather_gbps * 1e3) if gathered else 0.0,
            scatter_kernel_us=gpu.min_kernel_us,
        )

    def scatter_us(self, step: int, layer: int) -> float:
        """Compute-stream time of the scatter kernels of the copies of (``step``, ``layer``)."""
        return self.n_copies[step, layer] * self.scatter_kernel_us if self.gathered else 0.0

    def pipelined(self, nbytes: float, n: int) -> tuple[float, float, float]:
        """(first host cost, copy-stream duration, remaining host cost) of n pipelined copies."""
        h = self.host_per_copy_us + nbytes / max(n, 1) * self.gather_us_per_byte
        cpy = transfer_us(nbytes, self.h2d_gbps, self.latency_us, n) / n
        return h, cpy + (n - 1) * max(h, cpy), (n - 1) * h


class RecallIssuer:
    """The copy-stream unit: the host issues the recall copies of a step on the copy stream.

    Blocking (``recall='sync'``, pageable ``cudaMemcpy``): the host pays API + gather for every
    copy, the copy waits for the compute stream and the host waits for the copy. Otherwise
    the copies are pipelined on the copy stream and the host returns after issuing them.
    """

    def __init__(self, env: simpy.Environment, plan: RecallPlan, link: PcieLink, copy: Stream,
                 compute: Stream, memory: DecodeMemory, n_steps: int, blocking: bool) -> None:
        self.env, self.plan, self.link = env, plan, link
        self.copy, self.compute, self.memory = copy, compute, memory
        self.blocking = blocking
        self.host_copy_us = np.zeros(n_steps)  # host time issuing or blocked on copies

    def issue(self, step: int, layers: Iterable[int]) -> Generator[simpy.Event, None, dict]:
        """Host process part: issue the recalls of ``step`` for ``layers``; returns
        {layer: copy-done event} for the layers that recall."""
        events = {}
        for layer in layers:
            n = int(self.plan.n_copies[step, layer])
            if n:
                events[layer] = yield from self._issue_layer(step, layer, n)
        return events

    def _issue_layer(self, step: int, layer: int, n: int) -> Generator[simpy.Event, None, simpy.Event]:
        nbytes = float(self.plan.nbytes[step, layer])
        stage = self.memory.stage(nbytes) if self.plan.gathered else None
        t0 = self.env.now
        if self.blocking:
            done = yield from self._blocking_copies(step, nbytes, n)
        else:
            done = yield from self._pipelined_copies(step, nbytes, n)
        self.host_copy_us[step] += self.env.now - t0
        if stage is not None:
            self.memory.free_when_done(stage, done)
        return done

    def _blocking_copies(self, step: int, nbytes: float, n: int) -> Generator[simpy.Event, None, simpy.Event]:
        plan = self.plan
        yield self.env.timeout(n * plan.host_per_copy_us + nbytes * plan.gather_us_per_byte)
        done = self.copy.launch(transfer_us(nbytes, plan.h2d_gbps, plan.latency_us, n),
                                wait=(self.compute.done(),), channel=self.link.h2d, tag=step)
        yield done
        return done

    def _pipelined_copies(self, step: int, nbytes: float, n: int) -> Generator[simpy.Event, None, simpy.Event]:
        first_host, duration, rest_host = self.plan.pipelined(nbytes, n)
        yield self.env.timeout(first_host)
        done = self.copy.launch(duration, channel=self.link.h2d, tag=step)
        if rest_host:
            yield self.env.timeout(rest_host)
        return done
