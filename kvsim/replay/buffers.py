"""The compressed attention that policies read after each decode step (``decode_step`` of H2O,
WnW, ...), for every run that reads it, filled with batched elementwise products per layer.

A run's attention at a layer is the full attention restricted to what it read there,
renormalised: softmax over a subset of positions is the renormalised restriction of the full
softmax, so this is exactly what the compressed model computes (WnW §3.4 replay).
"""

from __future__ import annotations

import numpy as np

from kvsim.core.shapes import HeadLayout
from kvsim.replay.runstate import PolicyRun


class StepAttentionBuffers:
    """Step-attention buffers of every run whose policy reads them.

    The runs that read every layer share one (R_all, L, H_kv, g, T_a) array, whose rows of a
    layer are one contiguous block filled in place. A run that reads only some layers
    (``step_attention_layers``, e.g. WnW's anchor layers) gets a buffer of those layers plus
    one row of NaN that every other layer maps to (:class:`BufferStepView` ``rows``), so that
    reading one shows and the buffer costs only the layers read.
    """

    def __init__(self, runs: list[PolicyRun], heads: HeadLayout, n_audio: int) -> None:
        n_layers = heads.n_layers
        self.shape = (heads.n_kv_heads, heads.group)
        buffered = [r for r, run in enumerate(runs) if run.policy.needs_step_attention]
        every = [r for r in buffered if runs[r].policy.step_attention_layers() is None]
        self.buffers = np.zeros((len(every), n_layers, *self.shape, n_audio), dtype=np.float32)
        for b, r in enumerate(every):
            runs[r].buffer = self.buffers[b].reshape(n_layers, heads.n_q_heads, n_audio)
        #: per layer: the runs of the shared array (all of ``every``, rows ``[0, len(every))``)
        #: and, for the runs that read only some layers, (run, its buffer row of this layer)
        self.fills: list[tuple[list[int], list[tuple[int, np.ndarray]]]] = [
            (every, []) for _ in range(n_layers)]
        for r in buffered:
            if r not in every:
                self._own_buffer(runs[r], r, n_layers, n_audio)

    def _own_buffer(self, run: PolicyRun, r: int, n_layers: int, n_audio: int) -> None:
        """A buffer of the layers ``run`` reads, then a NaN row for every other layer."""
        layers = sorted(set(run.policy.step_attention_layers()))
        buffer = np.zeros((len(layers) + 1, *self.shape, n_audio), dtype=np.float32)
        buffer[-1] = np.nan
        rows = np.full(n_layers, len(layers), dtype=np.int64)
        for row, layer in enumerate(layers):
            rows[layer] = row
            self.fills[layer][1].append((r, buffer[row]))
        run.buffer = buffer.reshape(len(layers) + 1, -1, n_audio)
        run.buffer_rows = rows

    def fill(self, layer: int, audio_att: np.ndarray, run_masks: np.ndarray,
             normaliser: np.ndarray) -> None:
        """Write the compressed attention of ``layer`` into the buffers of the runs that read it.

        Parameters
        ----------
        audio_att : (H_kv, g, T_a) float32
            The full attention's audio columns.
        run_masks : (R, H_kv, T_a) float32
            What every run read at this layer (0/1).
        normaliser : (R, H_q) float32
            Every run's softmax normaliser (the attention mass it kept).
        """
        every, own = self.fills[layer]
        if every:
            kept = np.multiply(audio_att, run_masks[every][:, :, None, :],  # (n, H_kv, g, T_a)
                               out=self.buffers[:, layer])
            kept /= normaliser[every].reshape(len(every), *self.shape, 1)
        for r, row in own:
            np.multiply(audio_att, run_masks[r][:, None, :], out=row)
            row /= normaliser[r].reshape(*self.shape, 1)
