"""Record post-RoPE queries/keys(/values) of the text decoder while it decodes, without eager
attention: a custom attention function (registered with ``transformers.AttentionInterface``)
records its inputs and calls the stock sdpa function unchanged.

Per layer, the first call of a traced run is the prefill (``q_len`` = prompt length); every later
call is one decode step (``q_len`` = 1). ``key``/``value`` passed to the function include the
cache, so only the last ``q_len`` of them are new. Only calls whose module has a ``layer_idx``
(the text decoder's self-attention) are recorded; the function is installed for the text decoder
only (``attn_implementation={"text_config": TRACE_ATTN}``), audio encoders keep their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvsim.decode_attention import register_dispatching_attention, stock_attention

TRACE_ATTN = "kvsim_trace"

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "kvsim_trace_recorder", default=None
)


def register_trace_attention() -> str:
    """Register the recording attention function (and sdpa's mask under its name: without it
    transformers builds no mask for a custom implementation and padded inputs get wrong
    logits); idempotent; return its name. The function hands each decoder layer's call to the
    active :class:`Recorder` (:func:`kvsim.decode_attention.register_dispatching_attention`)."""
    return register_dispatching_attention(TRACE_ATTN, _ACTIVE)


@dataclass
class Recorder:
    """Collects, per layer, the new keys (and values) of every call and the queries of the
    positions the trace keeps: prompt positions ``>= window_start`` at prefill (the observation
    window, :func:`kvsim.trace.schema.observation_window`), all decode steps.

    Tensors stay on the model's device until :meth:`stacked` (one transfer per run).

    With ``decode_capacity`` (the most decode steps the run can take: ``max_new_tokens``) the
    decode steps are written into one buffer per layer and tensor, allocated at the first
    decode step, instead of one small tensor per step: thousands of small allocations
    interleaved with the KV cache that grows every step fragment glibc's heap. With one tensor
    per step, the peak RSS of tracing a 2.3-minute minivox clip was 1.3-4.4 GB from run to run
    (RSS growing through the decode steps); with the buffers, 1.4-1.6 GB
    (``benchmarks/trace_memory.py``).
    """

    n_layers: int
    window_start: int
    store_values: bool = False
    store_queries: bool = True
    store_keys: bool = True
    #: Called with the decode step index after layer 0 of each decode step (progress bars).
    on_step: Callable[[int], None] | None = None
    #: Optional ``(layer, key) -> key`` applied before attention (calibration perturbations).
    key_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    #: Keep the autograd graph of recorded tensors (calibration) instead of detaching.
    keep_graph: bool = False
    #: Most decode steps the run can take; when set (and not ``keep_graph``), decode steps go to
    #: preallocated buffers (see above) and a step beyond it is an error.
    decode_capacity: int | None = None
    keys: list[list[torch.Tensor]] = field(default_factory=list)
    values: list[list[torch.Tensor]] = field(default_factory=list)
    queries: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = [[] for _ in range(self.n_layers)]
        self.values = [[] for _ in range(self.n_layers)]
        self.queries = [[] for _ in range(self.n_layers)]
        # per layer: decode steps written into the buffers (element 1 of each list)
        self._n_buffered = [0] * self.n_layers

    @property
    def _buffered(self) -> bool:
        return self.decode_capacity is not None and not self.keep_graph

    def attention(self, module, layer: int, query, key, value, attention_mask, **kwargs):
        """Decoder layer ``layer``'s attention call: record its inputs (after ``key_hook``),
        then run the stock sdpa function on them."""
        if self.key_hook is not None:
            key = self.key_hook(layer, key)
        self.record(layer, query, key, value)
        return stock_attention(module, query, key, value, attention_mask, **kwargs)

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.shape[0] != 1:
            raise RuntimeError("the tracer records batch size 1 only")
        if not self.store_keys:
            return
        q_len = query.shape[2]
        first = not self.keys[layer]
        if not first and self._buffered:
            self._record_buffered(layer, query, key, value)
            return
        # clone: a slice is a view that would keep the whole key/value tensor of this call
        # (prompt + cache) alive — O(steps x context) memory on long audio
        grab = (lambda t: t.clone()) if self.keep_graph else (lambda t: t.detach().clone())
        self.keys[layer].append(grab(key[0, :, -q_len:, :]))
        if self.store_values:
            self.values[layer].append(grab(value[0, :, -q_len:, :]))
        if self.store_queries:
            q = query[0, :, self.window_start:, :] if first else query[0]
            self.queries[layer].append(grab(q))
        if layer == 0 and not first and self.on_step is not None:
            self.on_step(len(self.keys[0]) - 1)

    def _record_buffered(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> None:
        """One decode step into the layer's buffers (allocated at its first decode step)."""
        i = self._n_buffered[layer]
        if query.shape[2] != 1:
            raise RuntimeError(f"layer {layer}: a decode call with {query.shape[2]} queries; the "
                               "recorder's decode buffers take one token per step")
        if i >= self.decode_capacity:
            raise RuntimeError(f"decode step {i + 1} of layer {layer} exceeds the recorder's "
                               f"decode_capacity={self.decode_capacity}")
        new = [("keys", key[0, :, -1:, :])]
        if self.store_values:
            new.append(("values", value[0, :, -1:, :]))
        if self.store_queries:
            new.append(("queries", query[0]))
        with torch.no_grad():
            for name, t in new:
                parts = getattr(self, name)[layer]
                if len(parts) == 1:
                    parts.append(t.new_empty(t.shape[0], self.decode_capacity, t.shape[2]))
                parts[1][:, i : i + 1] = t
        self._n_buffered[layer] = i + 1
        if layer == 0 and self.on_step is not None:
            self.on_step(i + 1)

    @property
    def n_calls(self) -> int:
        if not self.keys or not self.keys[0]:
            return 0
        return 1 + self._n_buffered[0] if self._buffered else len(self.keys[0])

    def stacked(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Concatenate the calls: ``keys``/``values`` (L, H_kv, N, D), ``queries`` (L, H_q, N_q, D)
        on the CPU in ``dtype``."""
        out = {}
        names = ["keys"] + (["values"] if self.store_values else [])
        names += ["queries"] if self.store_queries else []
        for name in names:
            per_layer = []
            for i in range(self.n_layers):
                parts = getattr(self, name)[i]
                if self._buffered and len(parts) == 2:
                    parts = [parts[0], parts[1][:, : self._n_buffered[i]]]
                per_layer.append(torch.cat(parts, dim=1))
            out[name] = torch.stack(per_layer).to(device="cpu", dtype=dtype)
        return out


@contextlib.contextmanager
def recording(rec: Recorder) -> Iterator[Recorder]:
    """Activate ``rec`` for the attention calls made inside the block."""
    register_trace_attention()
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)
