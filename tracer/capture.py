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

TRACE_ATTN = "kvsim_trace"

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "kvsim_trace_recorder", default=None
)
_REGISTERED = False


def register_trace_attention() -> str:
    """Register the recording attention function and its mask (idempotent); return its name.

    The mask function is registered under the same name as sdpa's (``sdpa_mask``): without it
    transformers would build no mask for a custom implementation and padded inputs would get
    wrong logits (shared/notes/verified-facts.md).
    """
    global _REGISTERED
    if _REGISTERED:
        return TRACE_ATTN
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def trace_attention(module, query, key, value, attention_mask, **kwargs):
        rec = _ACTIVE.get()
        layer = getattr(module, "layer_idx", None)
        if rec is not None and layer is not None:
            if rec.key_hook is not None:
                key = rec.key_hook(layer, key)
            rec.record(layer, query, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(TRACE_ATTN, trace_attention)
    AttentionMaskInterface.register(TRACE_ATTN, sdpa_mask)
    _REGISTERED = True
    return TRACE_ATTN


@dataclass
class Recorder:
    """Collects, per layer, the new keys (and values) of every call and the queries of the
    positions the trace keeps: prompt positions ``>= window_start`` at prefill, all decode steps.

    Tensors stay on the model's device until :meth:`stacked` (one transfer per run).
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
    keys: list[list[torch.Tensor]] = field(default_factory=list)
    values: list[list[torch.Tensor]] = field(default_factory=list)
    queries: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys = [[] for _ in range(self.n_layers)]
        self.values = [[] for _ in range(self.n_layers)]
        self.queries = [[] for _ in range(self.n_layers)]

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.shape[0] != 1:
            raise RuntimeError("the tracer records batch size 1 only")
        if not self.store_keys:
            return
        q_len = query.shape[2]
        first = not self.keys[layer]
        grab = (lambda t: t) if self.keep_graph else (lambda t: t.detach())
        self.keys[layer].append(grab(key[0, :, -q_len:, :]))
        if self.store_values:
            self.values[layer].append(grab(value[0, :, -q_len:, :]))
        if self.store_queries:
            q = query[0, :, self.window_start:, :] if first else query[0]
            self.queries[layer].append(grab(q))
        if layer == 0 and not first and self.on_step is not None:
            self.on_step(len(self.keys[0]) - 1)

    @property
    def n_calls(self) -> int:
        return len(self.keys[0]) if self.keys else 0

    def stacked(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Concatenate the calls: ``keys``/``values`` (L, H_kv, N, D), ``queries`` (L, H_q, N_q, D)
        on the CPU in ``dtype``."""
        out = {}
        names = ["keys"] + (["values"] if self.store_values else [])
        names += ["queries"] if self.store_queries else []
        for name in names:
            per_layer = [torch.cat(getattr(self, name)[i], dim=1) for i in range(self.n_layers)]
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
