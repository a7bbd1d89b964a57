"""SimPy entities of the hardware model (docs/simulator.md).

- :class:`PcieLink` — full-duplex host link: one channel per direction (a ``simpy.Resource`` of
  capacity 1), a transfer holds its channel for ``alpha + bytes / beta``.
- :class:`Stream` — a CUDA stream: operations run one at a time in issue order; an operation
  may wait on events recorded on other streams (``cudaStreamWaitEvent``).
- :class:`HbmLedger` — HBM capacity and a byte ledger of live allocations with a high-water
  mark (weights, resident KV, staging buffers, workspace).

The host thread is a SimPy process written by the caller (:mod:`kvsim.sim.host`): it pays
launch/API costs as timeouts and blocks on stream events where the program synchronises.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import simpy

US = 1.0  # simulation time unit: microseconds


def transfer_us(nbytes: float, gbps: float, latency_us: float, n_transfers: int = 1) -> float:
    """Time of ``n_transfers`` back-to-back copies moving ``nbytes`` in total.

    One copy takes ``alpha + B / beta`` (alpha = ``latency_us``, beta = ``gbps`` in 1e9 B/s);
    copies queued on one channel serialise, so n copies take ``n * alpha + B_total / beta``.
    """
    if n_transfers <= 0 or nbytes <= 0:
        return 0.0
    return n_transfers * latency_us + nbytes / (gbps * 1e3)  # 1 GB/s = 1e3 B/us


class PcieLink:
    """A full-duplex PCIe link: independent H2D and D2H channels."""

    def __init__(self, env: simpy.Environment) -> None:
        self.h2d = simpy.Resource(env, capacity=1)
        self.d2h = simpy.Resource(env, capacity=1)
        self.busy_us = {"h2d": 0.0, "d2h": 0.0}


class Stream:
    """A CUDA stream: FIFO execution of operations, each optionally waiting on events.

    ``launch`` returns the operation's completion event (usable as a CUDA event by other
    streams or by the host). ``stall_us[tag]`` accumulates time an operation, already at the
    head of the stream, spent waiting on its ``wait`` events (e.g. compute waiting for a copy).
    """

    def __init__(self, env: simpy.Environment, name: str) -> None:
        self.env = env
        self.name = name
        self.tail: simpy.Event | None = None
        self.busy_us = 0.0
        self.stall_us: dict[int, float] = {}

    def launch(
        self,
        duration_us: float,
        wait: Iterable[simpy.Event] = (),
        channel: simpy.Resource | None = None,
        tag: int = -1,
    ) -> simpy.Event:
        proc = self.env.process(self._run(self.tail, float(duration_us), tuple(wait), channel, tag))
        self.tail = proc
        return proc

    def _run(self, prev, duration, wait, channel, tag):
        env = self.env
        if prev is not None:
            yield prev
        if wait:
            t0 = env.now
            yield from wait  # each already-processed event resumes immediately
            if env.now > t0:
                self.stall_us[tag] = self.stall_us.get(tag, 0.0) + (env.now - t0)
        if channel is not None:
            with channel.request() as req:
                yield req
                yield env.timeout(duration)
        else:
            yield env.timeout(duration)
        self.busy_us += duration

    def done(self) -> simpy.Event:
        """An event that fires when everything launched so far has finished (stream sync)."""
        if self.tail is None:
            ev = self.env.event()
            ev.succeed()
            return ev
        return self.tail


@dataclass
class _Alloc:
    tag: str
    nbytes: int


class HbmOutOfMemory(RuntimeError):
    """An allocation pushed live bytes above the HBM capacity."""


class HbmLedger:
    """Byte ledger of live HBM allocations with a high-water mark.

    ``high_water`` is the peak over time of the sum of live allocations; ``step_peak`` is the
    same peak since the last :meth:`reset_step_peak`. With ``strict`` an allocation beyond
    ``capacity`` raises :class:`HbmOutOfMemory`.
    """

    def __init__(self, capacity_bytes: int, strict: bool = False) -> None:
        self.capacity = int(capacity_bytes)
        self.strict = strict
        self.live = 0
        self.high_water = 0
        self.step_peak = 0
        self._allocs: dict[int, _Alloc] = {}
        self._next = 0
        self.by_tag: dict[str, int] = {}

    def alloc(self, tag: str, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError(f"allocation {tag!r}: negative size {nbytes}")
        handle = self._next
        self._next += 1
        self._allocs[handle] = _Alloc(tag, int(nbytes))
        self._add(tag, int(nbytes))
        return handle

    def resize(self, handle: int, nbytes: int) -> None:
        a = self._allocs[handle]
        delta = int(nbytes) - a.nbytes
        a.nbytes = int(nbytes)
        self._add(a.tag, delta)

    def free(self, handle: int) -> None:
        a = self._allocs.pop(handle)
        self._add(a.tag, -a.nbytes)

    def reset_step_peak(self) -> None:
        self.step_peak = self.live

    def _add(self, tag: str, delta: int) -> None:
        self.live += delta
        self.by_tag[tag] = self.by_tag.get(tag, 0) + delta
        if self.live > self.high_water:
            self.high_water = self.live
        if self.live > self.step_peak:
            self.step_peak = self.live
        if self.strict and delta > 0 and self.live > self.capacity:
            raise HbmOutOfMemory(
                f"HBM out of memory: {self.live / 2**30:.2f} GiB live > "
                f"{self.capacity / 2**30:.2f} GiB after allocating {tag!r}"
            )
