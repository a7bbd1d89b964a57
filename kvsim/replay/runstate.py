"""The state of one policy at one budget during a replay: its tiers, the GPU masks the batched
metrics read, its step log, and the time spent in policy code."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsim.core.invariants import check_capacity, check_gone_absorbing, check_tiers
from kvsim.policies.base import TIER_CPU, TIER_GPU, BufferStepView, Policy
from kvsim.replay.logwriter import StepLogWriter

if TYPE_CHECKING:
    from kvsim.policies.spec import PolicySpec


class PolicyRun:
    """One (policy, budget) of a replay.

    ``gpu_mask`` and ``resident`` start as arrays of their own and become slots of the arrays
    the engine shares between runs (:func:`kvsim.replay.steploop.share_gpu_masks`); the tier
    updates below write through to them. ``buffer`` (and ``buffer_rows`` when it holds only
    the layers the policy reads) is set by the step-attention buffers for a policy that reads
    the compressed attention after each step.
    """

    def __init__(self, spec: PolicySpec, policy: Policy, log: StepLogWriter) -> None:
        self.spec = spec
        self.policy = policy
        self.log = log
        self.tiers: np.ndarray | None = None  # (L, H_kv, T_a) uint8
        self.gpu: np.ndarray | None = None  # (L, H_kv, T_a) bool: tiers == GPU
        self.gpu_mask: np.ndarray | None = None  # (L, H_kv, T_a) float32 copy of ``gpu``
        self.resident: np.ndarray | None = None  # (L, H_kv) GPU-resident audio per KV-head
        self.n_gpu = 0  # GPU-resident audio tokens, all layers and KV-heads
        self.n_cpu = 0  # CPU-only audio tokens
        self.buffer: np.ndarray | None = None  # (L, H_q, T_a) compressed attention of a step
        self.buffer_rows: np.ndarray | None = None  # (L,) row of ``buffer`` of every layer
        self.history: list[np.ndarray] | None = None  # tiers after prefill and every step
        self.seconds = 0.0

    @property
    def label(self) -> str:
        return self.spec.label

    def timed(self, method: Callable[..., Any], *args: Any) -> Any:
        """``method(*args)``, its wall-clock time added to the policy's seconds."""
        t0 = time.perf_counter()
        out = method(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def set_tiers(self, tiers: np.ndarray) -> None:
        """Adopt new tiers and refresh the derived GPU masks used in the inner loop."""
        self.tiers = tiers.copy()
        self.gpu = self.tiers == TIER_GPU
        if self.gpu_mask is None:
            self.gpu_mask = self.gpu.astype(np.float32)
        else:
            self.gpu_mask[...] = self.gpu
        if self.resident is None:
            self.resident = self.gpu.sum(-1)
        else:
            self.resident[...] = self.gpu.sum(-1)
        self.n_gpu = int(self.resident.sum())
        self.n_cpu = int(np.count_nonzero(self.tiers == TIER_CPU))

    def update_tiers(self, changed: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
        """:meth:`set_tiers` for new tiers that differ from the current ones only at the flat
        indices ``changed`` (``before`` -> ``after``): the derived arrays are patched there."""
        np.put(self.tiers, changed, after)  # in place, whatever the memory layout
        on_gpu = after == TIER_GPU
        np.put(self.gpu, changed, on_gpu)
        np.put(self.gpu_mask, changed, on_gpu)
        delta = on_gpu.astype(np.int64) - (before == TIER_GPU)
        row = changed // self.tiers.shape[-1]  # (layer, KV-head) of every change
        per_row = np.bincount(row, weights=delta, minlength=self.resident.size)
        self.resident += per_row.astype(np.int64).reshape(self.resident.shape)
        self.n_gpu += int(delta.sum())
        self.n_cpu += int(np.count_nonzero(after == TIER_CPU) - np.count_nonzero(before == TIER_CPU))

    def end_step(self, step: int, check_invariants: bool) -> None:
        """The tier update of decode step ``step``: the policy's new tiers (``current_tiers``
        of a query-aware policy, else ``decode_step`` on the compressed attention), checked,
        counted in the step log and adopted."""
        prev = self.tiers
        if self.policy.query_aware:
            new = self.timed(self.policy.current_tiers)
        else:
            new = self.timed(self.policy.decode_step, BufferStepView(step, self.buffer, self.buffer_rows))
        if not (new is None or new is prev and not self.policy.query_aware):
            self._adopt_changes(new, step, check_invariants)
        self.log.record_tiers(step, self.n_gpu, self.n_cpu)
        if self.history is not None:
            self.history.append(self.tiers.copy())

    def _adopt_changes(self, new: np.ndarray, step: int, check_invariants: bool) -> None:
        """Check ``new`` tiers and adopt them; only the positions that changed tier matter:
        the rest cannot break an invariant, move, or change a count."""
        check_tiers(self.label, new, self.tiers.shape)
        changed = np.flatnonzero(self.tiers != new)
        if not changed.size:
            return
        before, after = self.tiers.ravel()[changed], new.ravel()[changed]
        if check_invariants:
            check_gone_absorbing(self.label, before, after, step)
        self.log.record_transfers(step, changed, before, after)
        self.update_tiers(changed, before, after)
        if check_invariants:
            check_capacity(self.label, self.policy, self.n_gpu, step)
