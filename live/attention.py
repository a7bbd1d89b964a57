"""The live attention function: policies applied *inside* the text decoder's attention.

A function registered with ``transformers.AttentionInterface`` under :data:`LIVE_ATTN` (and
``sdpa_mask`` under the same name in ``AttentionMaskInterface``, so padded inputs keep their
mask) receives, per decoder layer and
call, the post-RoPE ``query`` and the cached ``key``/``value``. With no active
:class:`~kvsim.live.session.LiveSession` it is exactly the stock sdpa function; with one, the
session decides per call (prefill: record the observation window and run full attention; decode:
merge the per-(layer, KV-head) keep-mask of the policy into the attention).

Eviction emulation (docs/live.md): a boolean keep-mask of shape
(H_kv, N) gives exactly zero attention mass to evicted positions; q-head ``h`` reads KV-head
``h // (H_q / H_kv)``. When nothing is masked the stock path is taken unchanged, which is the
only way to stay bit-identical to plain generation (an all-True mask switches sdpa kernels).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

LIVE_ATTN = "kvsim_live"

#: The session driving the attention calls of the current thread (None: plain sdpa).
ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("kvsim_live_session", default=None)
_REGISTERED = False


def register_live_attention() -> str:
    """Register the live attention function and its mask function (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return LIVE_ATTN
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def live_attention(module, query, key, value, attention_mask, **kwargs):
        session = ACTIVE.get()
        layer = getattr(module, "layer_idx", None)
        if session is None or layer is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return session.attention(module, layer, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(LIVE_ATTN, live_attention)
    AttentionMaskInterface.register(LIVE_ATTN, sdpa_mask)
    _REGISTERED = True
    return LIVE_ATTN


def stock_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def masked_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of one decode query with a per-KV-head keep-mask.

    Parameters
    ----------
    query : (1, H_q, 1, D)
    key, value : (1, H_kv, N, D)
    keep : (H_kv, N) bool, True where the position may be read
    scaling : softmax scale (1/sqrt(D))

    Returns
    -------
    (1, 1, H_q, D), the layout transformers' attention functions return.
    """
    _, h_q, q_len, d = query.shape
    h_kv = key.shape[1]
    if q_len != 1:
        raise ValueError("masked decode attention takes one query position")
    g = h_q // h_kv
    q = query.reshape(1, h_kv, g, d)  # q-head h -> kv-head h // g (GQA packing)
    mask = keep[None, :, None, :]  # (1, H_kv, 1, N), broadcast over the g queries
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(1, h_q, 1, value.shape[-1]).transpose(1, 2).contiguous()


def masked_attention_probs(
    query: torch.Tensor, key: torch.Tensor, keep: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Softmax the (masked) model computes for one decode query, float32, shape (H_q, N).

    Zero at masked positions; rows sum to one over the positions read.
    """
    _, h_q, _, d = query.shape
    h_kv, n = key.shape[1], key.shape[2]
    g = h_q // h_kv
    q = query.reshape(h_kv, g, d).float()
    logits = torch.matmul(q, key[0].float().transpose(1, 2)) * scaling  # (H_kv, g, N)
    if keep is not None:
        logits = logits.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(h_q, n)
