"""The host-thread unit of the decode program: the Python process that launches every step."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import numpy as np
import simpy

from kvsim.sim.hardware import Stream
from kvsim.sim.memory import DecodeMemory
from kvsim.sim.recalls import RecallIssuer

if TYPE_CHECKING:
    from kvsim.sim.engine import StepCosts

Events = dict[int, simpy.Event]


class HostThread:
    """The host thread as a SimPy process (:meth:`run`).

    Per step it launches each layer's kernels (eager: operators x (dispatcher cost + launch);
    CUDA graphs: one graph launch per step), issues the recalls — inside the step before the
    layer that reads them (``in_layer``), or at the end of the step for the next one — reads the
    sampled token back (a stream synchronisation) and pays the generate loop's per-step
    overhead. A layer whose recalls are on the copy stream waits for them (an event); a
    gathered recall adds its scatter kernels to the layer.

    Parameters
    ----------
    layer_us : (S,) array
        Compute-stream time of one layer at every step.
    resident_layer_bytes : (S,) array
        Resident KV of one layer at every step (whole batch).
    in_layer : bool
        Recalls decided at a step are issued inside it, before their layer.
    """

    def __init__(self, env: simpy.Environment, costs: StepCosts, compute: Stream,
                 recalls: RecallIssuer, memory: DecodeMemory, layer_us: np.ndarray,
                 resident_layer_bytes: np.ndarray, n_layers: int, in_layer: bool) -> None:
        self.env, self.costs, self.compute = env, costs, compute
        self.recalls, self.memory = recalls, memory
        self.layer_us, self.resident_layer_bytes = layer_us, resident_layer_bytes
        self.n_layers, self.in_layer = n_layers, in_layer
        n_steps = len(layer_us)
        self.step_us = np.zeros(n_steps)  # wall time of every step
        self.gpu_bytes = np.zeros(n_steps, dtype=np.int64)  # HBM peak of every step

    def run(self) -> Generator[simpy.Event, None, None]:
        """The SimPy process: every decode step, one after the other."""
        pending: Events = {}  # copies issued at the end of the last step, per layer
        for step in range(len(self.layer_us)):
            t_start = self.env.now
            self.memory.begin_step(self.resident_layer_bytes[step], self.n_layers)
            if self.costs.graph_launch_us:
                yield self.env.timeout(self.costs.graph_launch_us)
            for layer in range(self.n_layers):
                yield from self._launch_layer(step, layer, pending)
            pending = yield from self._end_step(step)
            self.step_us[step] = self.env.now - t_start
            self.gpu_bytes[step] = self.memory.step_peak

    def _launch_layer(self, step: int, layer: int, pending: Events) -> Generator[simpy.Event, None, None]:
        """Issue the layer's in-step recalls if any, then launch it after what it waits on."""
        plan = self.recalls.plan
        waits: tuple[simpy.Event, ...] = ()
        scatter_us = 0.0
        if self.in_layer and plan.n_copies[step, layer]:
            events = yield from self.recalls.issue(step, [layer])
            if not self.recalls.blocking:
                waits = (events[layer],)
            scatter_us = plan.scatter_us(step, layer)
        elif layer in pending:
            waits = (pending[layer],)
            scatter_us = plan.scatter_us(step - 1, layer)
        if self.costs.host_layer_us:
            yield self.env.timeout(self.costs.host_layer_us)
        self.compute.launch(self.layer_us[step] + scatter_us, wait=waits, tag=step)

    def _end_step(self, step: int) -> Generator[simpy.Event, None, Events]:
        """LM head, token read-back and loop overhead; then the recalls decided at this step
        (unless issued in-layer). Returns their copy events, per layer."""
        costs = self.costs
        if costs.host_head_us:
            yield self.env.timeout(costs.host_head_us)
        self.compute.launch(costs.gpu_head_us, tag=step)
        yield self.compute.done()  # greedy token read back to the host
        yield self.env.timeout(costs.host_step_fixed_us)
        if not self.in_layer and self.recalls.plan.n_copies[step].any():
            # sync: events already done (no stall), but scatter kernels still run next step
            return (yield from self.recalls.issue(step, range(self.n_layers)))
        return {}
