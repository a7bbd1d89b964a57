"""The HBM-ledger unit of the decode program: what the program allocates on the accelerator."""

from __future__ import annotations

import simpy

from kvsim.sim.hardware import HbmLedger
from kvsim.sim.presets import ModelPreset


class DecodeMemory:
    """HBM allocations of decoding ``batch`` sequences, kept in an :class:`HbmLedger`.

    The weights and the workspace (logits, MLP activations) live for the whole run; the
    resident KV is resized at every step; with a cache that grows by copy (``torch.cat``) a
    new layer tensor briefly lives next to the old one; gathered recalls hold a staging buffer
    until their copy is done.
    """

    def __init__(self, ledger: HbmLedger, model: ModelPreset, batch: int,
                 cache_copy_factor: float) -> None:
        self.ledger = ledger
        ledger.alloc("weights", model.weight_bytes)
        ledger.alloc("workspace", batch * (model.vocab_size * 4
                                           + 4 * model.intermediate_size * model.dtype_bytes))
        self._kv = ledger.alloc("kv", 0)
        self.cache_grows_by_copy = cache_copy_factor > 0

    def begin_step(self, resident_layer_bytes: float, n_layers: int) -> None:
        """Resize the resident KV to the step's (``resident_layer_bytes`` per layer) and start
        the step's peak."""
        self.ledger.resize(self._kv, int(resident_layer_bytes * n_layers))
        self.ledger.reset_step_peak()
        if self.cache_grows_by_copy:  # torch.cat: new layer tensor while the old one lives
            self.ledger.free(self.ledger.alloc("cache_growth", int(resident_layer_bytes)))

    @property
    def step_peak(self) -> int:
        """Peak live bytes since the step began."""
        return self.ledger.step_peak

    def stage(self, nbytes: float) -> int:
        """Allocate a staging buffer for a gathered copy; returns its handle."""
        return self.ledger.alloc("staging", int(nbytes))

    def free_when_done(self, handle: int, copy_done: simpy.Event) -> None:
        """Free a staging buffer once its copy is done (now, if it already is)."""
        if copy_done.callbacks is None:  # already processed (blocking copy)
            self.ledger.free(handle)
        else:
            copy_done.callbacks.append(lambda _e, h=handle: self.ledger.free(h))
