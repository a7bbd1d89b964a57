"""Whether the encoder's padding counts as audio in a replay: the trace as the engine reads it.

Whisper-style encoders (minivox, Voxtral) pad the audio to whole 30 s windows, and the tokens
encoded from that zero-padded tail stay in the KV cache as audio (``Trace.padding_positions``;
a 62 s clip is 1,125 audio tokens of which 345 are padding). Neither paper says whether such
tokens count; WnW §3.4 counts r_GPU over "audio tokens". A replay chooses:

* ``count`` (default): the trace as recorded; padding is audio like any other token (budgets
  ``floor(r·T_a)``, r_GPU, recall and every policy's view include it).
* ``drop``: the replay runs as if the padding were not in the cache. :class:`PaddingDroppedTrace`
  takes the padding positions out of the trace's position axis before the engine reads it, so
  T_a, budgets, r_GPU, recall, output error and every policy's view cover the real audio only,
  and the engine's attention is a softmax over the remaining keys, recomputed from the stored
  queries and keys. Keys and queries are post-RoPE, so taking positions out changes no dot
  product. The stored queries and keys were still computed by a model that saw the padding in
  every earlier layer: ``drop`` removes the padding from the cache the policies manage, not
  from the model that produced the trace.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from pathlib import Path

import numpy as np

from kvsim.core.shapes import HeadLayout, HeadScores
from kvsim.trace.reader import Trace
from kvsim.trace.schema import TraceMeta

#: ``ReplayConfig.padding`` / ``kvsim replay --padding``: keep the padding as audio, or drop it.
PADDING_MODES = ("count", "drop")


def check_padding_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`PADDING_MODES`, else a one-line ValueError."""
    if mode not in PADDING_MODES:
        raise ValueError(f"--padding: expected one of {', '.join(PADDING_MODES)}, got {mode!r}")
    return mode


class PaddingDroppedTrace:
    """A trace with its padding positions taken out of the position axis (``--padding drop``).

    Offers what the replay engine reads of a :class:`~kvsim.trace.reader.Trace`, renumbered:
    position ``i`` of the view is the ``i``-th position of the trace that is not padding, so
    the prompt is ``n_pad`` positions shorter and decode step ``s`` sits at ``n_prefill + s``
    as before. Keys and values lose the padding columns; queries are the trace's, looked up
    through the renumbering. The observation window keeps its non-padding queries only (a
    padding token's query is gone with it).

    Raises
    ------
    ValueError
        One line naming the trace when it does not record which positions are padding.
    """

    def __init__(self, trace: Trace) -> None:
        if not trace.padding_recorded:
            raise ValueError(
                f"{trace.path}: --padding drop: the trace does not record which audio positions "
                "are padding (positions.parquet has no 'padding' column); replay it with "
                "--padding count or re-trace it")
        self.source = trace
        meta = trace.meta
        padding = np.intersect1d(trace.padding_positions, trace.audio_positions)
        keep = np.ones(meta.n_positions, dtype=bool)
        keep[padding] = False
        self.n_padding = len(padding)
        #: view position -> trace position
        self.kept = np.flatnonzero(keep)
        self._view_of = np.cumsum(keep) - 1  # trace position -> view position (where kept)
        self._keep = keep
        if not keep[trace.window_positions].any():
            raise ValueError(f"{trace.path}: --padding drop: every observation-window query is padding")
        self.meta: TraceMeta = dataclasses.replace(
            meta, n_positions=len(self.kept),
            n_prefill=meta.n_prefill - int((padding < meta.n_prefill).sum()))

    def _renumber(self, positions: np.ndarray) -> np.ndarray:
        """The view positions of the non-padding ``positions`` of the trace."""
        return self._view_of[positions[self._keep[positions]]].astype(np.int64)

    @cached_property
    def audio_positions(self) -> np.ndarray:
        """The audio positions that are not padding, ascending (T_a − n_pad,)."""
        return self._renumber(self.source.audio_positions)

    @property
    def n_audio(self) -> int:
        return len(self.audio_positions)

    @cached_property
    def window_positions(self) -> np.ndarray:
        """The observation window's non-padding query positions."""
        return self._renumber(self.source.window_positions)

    def query_index(self, position: int) -> int:
        """Row in :meth:`queries` of the query at view position ``position``."""
        return self.source.query_index(int(self.kept[position]))

    def queries(self, layer: int) -> np.ndarray:
        """The trace's stored queries of ``layer`` (H_q, N_q, D); rows by :meth:`query_index`."""
        return self.source.queries(layer)

    def read_layer(self, name: str, layer: int) -> np.ndarray:
        """One layer of ``keys`` or ``values`` without the padding positions (H_kv, N', D), or
        of ``queries`` as stored."""
        arr = self.source.read_layer(name, layer)
        if name == "queries" or not self.n_padding:
            return arr
        return arr[:, self.kept]

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def head_layout(self) -> HeadLayout:
        return self.source.head_layout

    @property
    def head_scores(self) -> HeadScores | None:
        return self.source.head_scores


#: What the replay engine reads: a trace as recorded, or with its padding dropped.
ReplayTrace = Trace | PaddingDroppedTrace


def trace_for_replay(trace: Trace, mode: str) -> ReplayTrace:
    """The trace as a replay with ``--padding mode`` reads it (see the module docstring)."""
    return PaddingDroppedTrace(trace) if check_padding_mode(mode) == "drop" else trace
