"""Writes the step log of one replayed run (columns of :mod:`kvsim.core.steplog`).

The engine fills, step by step, the columns that differ between runs (tier counts, reads,
transfers) in preallocated integer arrays; the columns every run shares (step, context) are
added when the frame is built.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from kvsim.core.shapes import HeadLayout
from kvsim.core.steplog import STEP_LOG_COLUMNS
from kvsim.core.tiers import TIER_CPU, TIER_GPU

#: step-log columns that differ between runs, in the order of ``StepLogWriter.run_columns``
RUN_COLUMNS = ("gpu_audio_tokens", "cpu_audio_tokens", "read_audio_tokens", "h2d_tokens",
               "h2d_bytes", "h2d_transfers", "released_tokens")
_GPU, _CPU, _READ, _H2D, _H2D_BYTES, _TRANSFERS, _RELEASED = range(len(RUN_COLUMNS))


class StepLogWriter:
    """The per-run columns of a step log, one row per decode step, filled in place.

    Parameters
    ----------
    heads : HeadLayout
        Attention shape of the traced model.
    n_audio : int
        T_a, audio positions per (layer, KV-head).
    n_steps : int
        Decode steps replayed (rows).
    dtype_bytes : int
        Bytes of one stored K or V element (for ``h2d_bytes``).
    """

    def __init__(self, heads: HeadLayout, n_audio: int, n_steps: int, dtype_bytes: int) -> None:
        self.n_audio = n_audio
        self.n_layers = heads.n_layers
        self.row_size = heads.n_kv_heads * n_audio  # flat tier positions of one layer
        self.token_bytes = 2 * heads.head_dim * dtype_bytes  # K and V of one position
        self.run_columns = np.zeros((n_steps, len(RUN_COLUMNS)), dtype=np.int64)
        #: per step: positions recalled per layer (row 0) and their contiguous runs (row 1)
        self.by_layer = np.zeros((n_steps, 2, heads.n_layers), dtype=np.int64)

    def record_tiers(self, step: int, n_gpu: int, n_cpu: int) -> None:
        """GPU-resident and CPU-only audio tokens after the tier update of ``step``."""
        row = self.run_columns[step]
        row[_GPU] = n_gpu
        row[_CPU] = n_cpu

    def record_constant_tiers(self, n_gpu: int, n_cpu: int) -> None:
        """The same tier counts at every step (a run whose tiers never change after prefill)."""
        self.run_columns[:, _GPU], self.run_columns[:, _CPU] = n_gpu, n_cpu

    def record_reads(self, reads: np.ndarray) -> None:
        """Audio tokens attention read at every step (summed over layers and KV-heads)."""
        self.run_columns[:, _READ] = reads

    def record_transfers(self, step: int, changed: np.ndarray, before: np.ndarray,
                         after: np.ndarray) -> None:
        """Transfer columns from the flat tier indices (ascending) that changed at ``step``,
        ``before`` -> ``after``: CPU→GPU recalls per layer, their contiguous runs along the
        audio of each (layer, KV-head) row, and the positions leaving GPU."""
        n_audio = self.n_audio
        recalled = changed[(before == TIER_CPU) & (after == TIER_GPU)]
        layer_of = recalled // self.row_size
        # a recalled position starts a run at the start of its row or after a gap
        starts = np.ones(recalled.size, dtype=bool)
        starts[1:] = np.diff(recalled) != 1
        starts |= recalled % n_audio == 0
        by_layer = self.by_layer[step]
        by_layer[0] = np.bincount(layer_of, minlength=self.n_layers)
        by_layer[1] = np.bincount(layer_of[starts], minlength=self.n_layers)
        row = self.run_columns[step]
        row[_H2D] = recalled.size
        row[_H2D_BYTES] = recalled.size * self.token_bytes
        row[_TRANSFERS] = np.count_nonzero(starts)
        row[_RELEASED] = np.count_nonzero((before == TIER_GPU) & (after != TIER_GPU))

    def frame(self, n_prefill: int) -> pl.DataFrame:
        """The step log (:data:`STEP_LOG_COLUMNS`) of a replay whose prompt has ``n_prefill``
        positions."""
        n_steps = self.run_columns.shape[0]
        context = n_prefill + np.arange(n_steps, dtype=np.int64) + 1
        arrays: dict[str, np.ndarray] = {
            "step": np.arange(n_steps, dtype=np.int64),
            "context_tokens": context,
            "non_audio_tokens": context - self.n_audio,
            "h2d_tokens_by_layer": self.by_layer[:, 0],
            "h2d_transfers_by_layer": self.by_layer[:, 1],
        }
        arrays.update({name: self.run_columns[:, i] for i, name in enumerate(RUN_COLUMNS)})
        columns = []
        for name, dtype in STEP_LOG_COLUMNS.items():
            col = pl.Series(name, np.ascontiguousarray(arrays[name]))
            columns.append(col if col.dtype == dtype else col.cast(dtype))
        return pl.DataFrame(columns)
