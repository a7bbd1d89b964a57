"""Query-aware selection in replay: the ``select`` / ``select_layers`` hooks of the policies that
choose, from the current query, which GPU-resident audio attention reads (Quest, ArkVale), and
the check that they read only what is on GPU.

Replay is open loop: every layer's query of a step is known before the step, so the policies
that can select all layers at once do so (``select_layers``); the others are called per layer.
What a run reads at a layer is written into its slot of the engine's shared mask array before
the layer's metrics read it; its tiers stay in the run's own state.
"""

from __future__ import annotations

import numpy as np

from kvsim.core.invariants import InvariantViolation
from kvsim.policies.base import (
    TIER_GPU,
    ArrayQueryView,
    ArrayStepQueryView,
)
from kvsim.replay.runstate import PolicyRun


class QueryAwareSelection:
    """The query-aware runs of a replay and what their selections read.

    Parameters
    ----------
    runs : list of PolicyRun
        Every run of the replay, in the order of the slots of the shared mask arrays.
    audio_keys : list of (H_kv, T_a, D) float32
        Audio keys of every layer, shown to the policies.
    """

    def __init__(self, runs: list[PolicyRun], audio_keys: list[np.ndarray]) -> None:
        self.query_aware = [(r, run) for r, run in enumerate(runs) if run.policy.query_aware]
        self.all_layers = [(r, run) for r, run in self.query_aware
                           if run.policy.selects_all_layers]
        self.per_layer = [(r, run) for r, run in self.query_aware
                          if not run.policy.selects_all_layers]
        self.per_layer_slots = np.array([r for r, _ in self.per_layer], dtype=np.int64)
        self.audio_keys = audio_keys
        #: per run and layer: whether its selection at this step returned a mask (not None)
        self.checked = np.zeros((len(runs), len(audio_keys)), dtype=bool)

    def select_step(self, step: int, queries: list[np.ndarray], masks: np.ndarray,
                    resident: np.ndarray) -> None:
        """``select_layers`` of the runs that select every layer of ``step`` at once: what each
        reads at every layer goes to its slots of ``masks`` (L, R + 1, H_kv, T_a) and
        ``resident`` (L, R, H_kv)."""
        if not self.all_layers:
            return
        view = ArrayStepQueryView(step, np.stack(queries), self.audio_keys, memo={})
        for r, run in self.all_layers:
            reads = run.timed(run.policy.select_layers, view)
            masks[:, r] = run.gpu if reads is None else reads
            resident[:, r] = masks[:, r].sum(-1)
            self.checked[r] = reads is not None

    def select_layer(self, step: int, layer: int, q: np.ndarray, run_masks: np.ndarray,
                     resident: np.ndarray) -> None:
        """``select`` of the per-layer runs at ``layer``: what each reads goes to its slot of
        ``run_masks`` (R, H_kv, T_a) and ``resident`` (R, H_kv)."""
        if not self.per_layer:
            return
        qview = ArrayQueryView(step, layer, q, self.audio_keys[layer], memo={})
        for r, run in self.per_layer:
            sel = run.timed(run.policy.select, qview)
            # None: it reads every GPU-resident position of its tiers before the step
            run_masks[r] = run.gpu[layer] if sel is None else sel
            self.checked[r, layer] = sel is not None
        slots = self.per_layer_slots
        resident[slots] = run_masks[slots].sum(-1)

    def check_reads(self, masks: np.ndarray, step: int) -> None:
        """Every position a selection read at ``step`` was on GPU at that layer.

        Checked once per step against the tiers after the step: ``select`` of a layer changes
        only that layer's tiers (protocol), so they are the tiers it left at its layer.
        """
        for r, run in self.query_aware:
            cur = run.policy.current_tiers()
            if cur is None and run.n_gpu == run.tiers.size:
                continue  # every position on GPU (Quest): nothing can be read off GPU
            tiers = run.tiers if cur is None else cur
            off_gpu = ((masks[:, r] != 0) & (tiers != TIER_GPU)).any(axis=-1).any(axis=-1)
            off_gpu &= self.checked[r]
            if off_gpu.any():
                raise InvariantViolation(
                    f"{run.label}: select() read audio that is not on GPU "
                    f"(step {step}, layer {int(np.flatnonzero(off_gpu)[0])})")
