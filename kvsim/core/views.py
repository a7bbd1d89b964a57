"""The views through which a policy sees attention (prefill, decode step, per-layer query),
and their array-backed implementations used by the drivers (replay engine, live decoding).

A policy sees the world only through these, so the same policy object runs in replay and in
live decoding without knowing which.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from kvsim.core.attention import causal_attention_columns

T = TypeVar("T")


class PrefillView(Protocol):
    """What a policy sees at prefill."""

    @property
    def n_window(self) -> int:
        """Number of observation-window queries (prompt positions after the audio)."""
        ...

    def audio_attention(self, layer: int) -> np.ndarray:
        """Full-model softmax of the observation-window queries, audio columns only.

        Shape (H_q, W, T_a), float32. Rows do not sum to one (non-audio columns are omitted).
        """
        ...

    def audio_keys(self, layer: int) -> np.ndarray:
        """Post-RoPE audio keys, shape (H_kv, T_a, D), float32."""
        ...


class StepView(Protocol):
    """What a policy sees after decode step ``step`` has been computed for every layer."""

    @property
    def step(self) -> int: ...

    def audio_attention(self, layer: int) -> np.ndarray:
        """Attention the compressed model computed over the audio at this step.

        Shape (H_q, T_a), float32; renormalised over the positions the model could see
        (all non-audio plus the resident audio of each head); zero where not resident.
        """
        ...


class QueryView(Protocol):
    """Input of the per-layer, query-aware :meth:`Policy.select` hook."""

    @property
    def step(self) -> int: ...

    @property
    def layer(self) -> int: ...

    def query(self) -> np.ndarray:
        """Post-RoPE query of the current token at this layer, shape (H_q, D), float32."""
        ...

    def audio_keys(self) -> np.ndarray:
        """Post-RoPE audio keys at this layer, shape (H_kv, T_a, D), float32."""
        ...


class StepQueryView(Protocol):
    """Input of the optional :meth:`Policy.select_layers` fast path: the queries of *every*
    layer at one decode step. Only an open-loop driver (replay of recorded queries) knows them
    before attention runs; live decoding calls :meth:`Policy.select` layer by layer."""

    @property
    def step(self) -> int: ...

    def queries(self) -> np.ndarray:
        """Post-RoPE queries of the current token at every layer, shape (L, H_q, D), float32."""
        ...

    def audio_keys(self, layer: int) -> np.ndarray:
        """Post-RoPE audio keys of ``layer``, shape (H_kv, T_a, D), float32."""
        ...


@dataclass
class BufferStepView:
    """A :class:`StepView` over a buffer that the driver (replay engine or live decoding)
    fills with the compressed attention of every layer the policy reads.

    ``buffer`` is (L, H_q, T_a), one row per layer, when ``rows`` is None; otherwise ``rows``
    (L,) gives the buffer row of every layer, and the layers the policy does not read share a
    row of NaN (so that reading one shows), which keeps the buffer as small as the layers read.
    """

    step: int
    buffer: np.ndarray | None
    rows: np.ndarray | None = None

    def audio_attention(self, layer: int) -> np.ndarray:
        if self.buffer is None:
            raise RuntimeError("policy did not set needs_step_attention = True")
        return self.buffer[layer if self.rows is None else self.rows[layer]]


def all_audio_attention(view: StepView, n_layers: int) -> np.ndarray:
    """Every layer's :meth:`StepView.audio_attention` as one (L, H_q, T_a) array (read-only use).

    The driver's :class:`BufferStepView` with a row per layer already holds them in one buffer,
    returned as is; any other view is stacked layer by layer.
    """
    if isinstance(view, BufferStepView) and view.buffer is not None and view.rows is None:
        return view.buffer
    return np.stack([view.audio_attention(layer) for layer in range(n_layers)])


@dataclass
class ArrayQueryView:
    """A :class:`QueryView` over one layer's query and audio keys. ``memo`` (optional) is
    shared by the policies the driver runs on this step and layer (see :func:`shared`)."""

    step: int
    layer: int
    _q: np.ndarray
    _keys: np.ndarray
    memo: dict | None = None

    def query(self) -> np.ndarray:
        return self._q

    def audio_keys(self) -> np.ndarray:
        return self._keys


@dataclass
class ArrayStepQueryView:
    """A :class:`StepQueryView` over stacked queries and per-layer audio keys; ``memo`` as in
    :class:`ArrayQueryView`, shared by the policies the driver runs at this step."""

    step: int
    _queries: np.ndarray
    _keys: Sequence[np.ndarray]
    memo: dict | None = None

    def queries(self) -> np.ndarray:
        return self._queries

    def audio_keys(self, layer: int) -> np.ndarray:
        return self._keys[layer]


def shared(view: Any, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, shared by every policy that asks for ``key`` at this step and layer.

    The replay engine drives many policies and budgets over the same query; quantities that do
    not depend on the budget (Quest / ArkVale page bounds) are then computed once. A view
    without a ``memo`` mapping (e.g. live decoding of one policy) just computes.
    """
    memo = getattr(view, "memo", None)
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


#: bytes of window attention a :class:`WindowPrefillView` keeps across requests
PREFILL_CACHE_BYTES = 64 << 20


class WindowPrefillView:
    """The :class:`PrefillView` of replay and live decoding: full-model causal attention of the
    observation-window queries, restricted to the audio, shared by every policy of the run.

    A layer's attention, (H_q, W, T_a) float32, is as large as that layer's float32 keys when
    H_q·W = H_kv·D (Voxtral-mini), so keeping every layer would double a long trace's memory.
    The layers computed first are kept up to ``cache_bytes`` in all, plus the last one asked
    for; any other layer is recomputed, identically, when asked for again. (Policies scan the
    layers in order, one pass per score they compute: a least-recently-used cache smaller than
    the scan would miss on every layer.) A layer is computed one KV-head at a time
    (:func:`kvsim.core.attention.causal_attention_columns`), so only one KV-head's attention
    over every position exists beside the result.
    """

    def __init__(self, queries: Callable[[int], np.ndarray], keys: Sequence[np.ndarray],
                 window: np.ndarray, audio: np.ndarray,
                 cache_bytes: int = PREFILL_CACHE_BYTES) -> None:
        self._queries = queries  # layer -> (H_q, W, D) float32
        self._keys = keys  # per layer (H_kv, N, D) float32
        self._window = window
        self._audio = audio
        self._cache: dict[int, np.ndarray] = {}
        self._cache_free = cache_bytes
        self._last: tuple[int, np.ndarray] | None = None
        #: results shared by every policy prefilled on this view (see ``kvsim.policies.base.shared``)
        self.memo: dict = {}

    @property
    def n_window(self) -> int:
        return len(self._window)

    def audio_attention(self, layer: int) -> np.ndarray:
        if layer in self._cache:
            return self._cache[layer]
        if self._last is not None and self._last[0] == layer:
            return self._last[1]
        self._last = None  # freed before the next layer is computed
        out = causal_attention_columns(self._queries(layer), self._keys[layer], self._window,
                                       self._audio)
        if out.nbytes <= self._cache_free:
            self._cache[layer] = out
            self._cache_free -= out.nbytes
        else:
            self._last = (layer, out)
        return out

    def audio_keys(self, layer: int) -> np.ndarray:
        return np.ascontiguousarray(self._keys[layer][:, self._audio])
