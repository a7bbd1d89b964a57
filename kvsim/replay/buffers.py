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
        #: the runs of the shared array (its rows ``[0, len(every))``)
        self.every = every
        #: per layer: (run, its buffer row of this layer) of the runs that read only some layers
        self.own: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n_layers)]
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
            self.own[layer].append((r, buffer[row]))
        run.buffer = buffer.reshape(len(layers) + 1, -1, n_audio)
        run.buffer_rows = rows

    def fill_layers(self, layers: range, audio_att: np.ndarray, run_masks: np.ndarray,
                    normaliser: np.ndarray) -> None:
        """Write the compressed attention of the consecutive ``layers`` into the buffers of the
        runs that read them (the runs reading every layer in one product over the layers).

        Parameters
        ----------
        audio_att : (G, H_kv, g, T_a) float32
            The full attention's audio columns at the G layers.
        run_masks : (G, R, H_kv, T_a) float32
            What every run read at those layers (0/1).
        normaliser : (G, R, H_q) float32
            Every run's softmax normaliser (the attention mass it kept) there.
        """
        every, n_layers = self.every, len(layers)
        if every:
            kept = np.multiply(audio_att[None],  # (n, G, H_kv, g, T_a)
                               run_masks[:, every].transpose(1, 0, 2, 3)[:, :, :, None, :],
                               out=self.buffers[:, layers.start:layers.stop])
            kept /= normaliser[:, every].transpose(1, 0, 2).reshape(
                len(every), n_layers, *self.shape, 1)
        for i, layer in enumerate(layers):
            for r, row in self.own[layer]:
                np.multiply(audio_att[i], run_masks[i, r][:, None, :], out=row)
                row /= normaliser[i, r].reshape(*self.shape, 1)
