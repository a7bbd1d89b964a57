"""The compressed attention that policies read after each decode step (``decode_step`` of H2O,
WnW, ...), for every run that reads it, in one array filled with one batched product per layer.

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

    A layer is filled only for the runs that read it (``step_attention_layers``); the others
    hold NaN there, so that reading one shows. Runs reading every layer come first, so that a
    layer only they read is a contiguous block filled in place.
    """

    def __init__(self, runs: list[PolicyRun], heads: HeadLayout, n_audio: int) -> None:
        n_layers, group = heads.n_layers, heads.group
        self.shape = (heads.n_kv_heads, group)
        buffered = sorted((r for r, run in enumerate(runs) if run.policy.needs_step_attention),
                          key=lambda r: runs[r].policy.step_attention_layers() is not None)
        self.buffers = np.zeros((len(buffered), n_layers, heads.n_kv_heads, group, n_audio),
                                dtype=np.float32)
        readers: list[list[int]] = [[] for _ in range(n_layers)]  # per layer: buffers filled
        for b, r in enumerate(buffered):
            runs[r].buffer = self.buffers[b].reshape(n_layers, heads.n_q_heads, n_audio)
            layers = runs[r].policy.step_attention_layers()
            for layer in range(n_layers) if layers is None else sorted(set(layers)):
                readers[layer].append(b)
        #: per layer: the runs filled there and their buffer rows (a slice when contiguous)
        self.fills: list[tuple[list[int], list[int] | slice]] = []
        for layer in range(n_layers):
            rows = readers[layer]
            self.buffers[[b for b in range(len(buffered)) if b not in rows], layer] = np.nan
            self.fills.append(([buffered[b] for b in rows],
                               slice(0, len(rows)) if rows == list(range(len(rows))) else rows))

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
        fill_runs, fill_rows = self.fills[layer]
        if not fill_runs:
            return
        in_place = isinstance(fill_rows, slice)
        kept = np.multiply(audio_att, run_masks[fill_runs][:, :, None, :],  # (n, H_kv, g, T_a)
                           out=self.buffers[fill_rows, layer] if in_place else None)
        kept /= normaliser[fill_runs].reshape(len(fill_runs), *self.shape, 1)
        if not in_place:
            self.buffers[fill_rows, layer] = kept
