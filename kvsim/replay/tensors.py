"""The recorded tensors a replay reads at every decode step, and the one attention pass per
(step, layer) that every replayed run shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvsim.core.attention import as_f32, decode_attention_block, gqa_logits, softmax_
from kvsim.core.shapes import HeadLayout
from kvsim.replay.padding import ReplayTrace


class LayerAttention(NamedTuple):
    """The full model's attention of one decode step at one layer."""

    full: np.ndarray  #: (H_q, p + 1) softmax over every position up to the current one
    audio: np.ndarray  #: (H_kv, g, T_a) its audio columns (a view when the audio is contiguous)


@dataclass
class TraceTensors:
    """Keys, values and layout of a trace, as float32 arrays kept in memory for the replay.

    Attributes
    ----------
    trace : Trace or PaddingDroppedTrace
        The trace as the replay reads it; queries are read from it step by step.
    keys : list of (H_kv, N, D) float32
        Post-RoPE keys of every layer.
    values : list of (H_kv, N, D) float32, or None
        Values of every layer when the trace stores them (output error).
    audio_index : slice or (T_a,) int array
        The audio positions: a slice when they are contiguous (views instead of copies).
    non_audio : (N,) bool
        True at the positions that are not audio.
    """

    trace: ReplayTrace
    keys: list[np.ndarray]
    values: list[np.ndarray] | None
    audio_index: slice | np.ndarray
    non_audio: np.ndarray
    #: decode steps whose attention :meth:`attention` computes in one product per layer
    #: (:func:`steps_per_block`); 1 = one step and layer at a time
    step_block: int = 1
    #: decode steps whose queries are read and converted at once (rounded up to whole
    #: attention blocks)
    query_block: int = 32
    #: (first position, (L, H_q, B, D) float32) of the block of decode queries read last
    _queries: tuple[int, np.ndarray] = field(default=(-1, np.empty((0, 0, 0, 0), np.float32)),
                                             repr=False)
    #: per layer: (first position, (H_q, B, n) attention) of the block computed last
    _blocks: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, trace: ReplayTrace, block_bytes: int = 0) -> TraceTensors:
        """Read every layer's keys and, if stored, values, converted to float32 once.

        Every decode step reads every layer's keys, so the conversion pays for itself; the
        layers are read one at a time with file reads (:meth:`Trace.read_layer`), not through
        the memory map, so the storage-dtype pages never join the resident set: peak memory
        is the float32 copy plus one layer (2x the stored float16 keys). ``block_bytes``: the
        memory the decode-step attention computed ahead may hold (:func:`steps_per_block`).
        """
        n_layers = trace.head_layout.n_layers
        audio = trace.audio_positions
        lo, hi = int(audio[0]), int(audio[-1]) + 1
        non_audio = np.ones(trace.meta.n_positions, dtype=bool)
        non_audio[audio] = False
        return cls(
            trace=trace,
            keys=[as_f32(trace.read_layer("keys", layer)) for layer in range(n_layers)],
            values=([as_f32(trace.read_layer("values", layer)) for layer in range(n_layers)]
                    if trace.meta.has_values else None),
            audio_index=slice(lo, hi) if hi - lo == len(audio) else audio,
            non_audio=non_audio,
            step_block=steps_per_block(trace.head_layout, trace.meta.n_positions, block_bytes),
        )

    def audio_keys(self) -> list[np.ndarray]:
        """(H_kv, T_a, D) audio keys of every layer."""
        return [k[:, self.audio_index] for k in self.keys]

    def step_queries(self, position: int) -> list[np.ndarray]:
        """(H_q, D) float32 query of the decode step at ``position`` (≥ ``n_prefill``), for
        every layer.

        It comes from the block of decode queries it belongs to (:meth:`_decode_queries`),
        read and converted once for the step queries and the attention blocks alike (the
        same float32 values as one row at a time).
        """
        first, block = self._decode_queries(position)
        return list(block[:, :, position - first])

    def _decode_queries(self, position: int) -> tuple[int, np.ndarray]:
        """(first position, (L, H_q, B, D) float32 queries) of the block of decode positions
        that holds ``position``: a fixed grid from the first decode step, blocks of
        ``query_block`` rounded up to whole attention blocks (so that every attention block
        lies in one), clipped at the trace's end."""
        first, block = self._queries
        if not 0 <= position - first < block.shape[2]:
            size = -(-self.query_block // self.step_block) * self.step_block
            n_prefill = self.trace.meta.n_prefill
            first = n_prefill + (position - n_prefill) // size * size
            rows = [self.trace.query_index(p)
                    for p in range(first, min(first + size, self.trace.meta.n_positions))]
            block = np.stack([as_f32(self.trace.queries(layer)[:, rows])
                              for layer in range(len(self.keys))])
            self._queries = first, block
        return first, block

    def attention(self, q: np.ndarray, layer: int, position: int, group: int) -> LayerAttention:
        """Full attention ``softmax(q Kᵀ/√d)`` of the query at ``position`` over the keys of
        ``layer`` up to it (GQA groups of ``group`` q-heads), and its audio part.

        With ``step_block`` > 1 it is a row of the block of decode steps computed with it
        (:func:`kvsim.core.attention.decode_attention_block`; ``q`` then comes from the
        block's decode queries).
        """
        n_prefill = self.trace.meta.n_prefill
        if self.step_block > 1 and position >= n_prefill:
            att = self._block_row(layer, position, n_prefill)
        else:
            att = softmax_(gqa_logits(q, self.keys[layer][:, : position + 1]))  # (H_q, p + 1)
            self._blocks[layer] = position, att[:, None]
        audio = att[:, self.audio_index]
        return LayerAttention(att, audio.reshape(-1, group, audio.shape[-1]))

    def block(self, layer: int) -> tuple[int, np.ndarray]:
        """(first position, (H_q, B, n) attention) of the block of decode steps that the last
        :meth:`attention` call at ``layer`` read: its ``step_block`` steps (a block of one
        step, the step itself, with ``step_block`` = 1), over positions up to the last one."""
        return self._blocks[layer]

    def _block_row(self, layer: int, position: int, n_prefill: int) -> np.ndarray:
        """(H_q, p + 1) attention of ``position`` at ``layer``, a view of its block's row.

        Blocks are a fixed grid of ``step_block`` steps from the first decode step (clipped at
        the trace's end), whatever the steps replayed, so a step's values do not depend on
        ``max_steps``."""
        first, block = self._blocks.get(layer, (-1, None))
        if block is None or not 0 <= position - first < block.shape[1]:
            first = n_prefill + (position - n_prefill) // self.step_block * self.step_block
            positions = np.arange(first, min(first + self.step_block, self.trace.meta.n_positions))
            q_first, q_block = self._decode_queries(first)
            rows = slice(first - q_first, first - q_first + len(positions))
            queries = np.ascontiguousarray(q_block[layer][:, rows])
            block = decode_attention_block(queries, self.keys[layer], positions)
            self._blocks[layer] = first, block
        return block[:, position - first, : position + 1]


def steps_per_block(heads: HeadLayout, n_positions: int, block_bytes: int,
                    most: int = 16) -> int:
    """Decode steps whose attention is computed in one product: as many as the attention of
    every layer for those steps, L × H_q × B × N float32, fits in ``block_bytes`` (at most
    ``most``; 1 when not even two fit, the per-step computation)."""
    per_step = heads.n_layers * heads.n_q_heads * n_positions * 4
    return int(min(most, max(1, block_bytes // max(per_step, 1))))
