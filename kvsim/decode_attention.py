"""Decode-step attention functions for transformers' attention interface (torch).

Shared by the tracer (:mod:`kvsim.tracer.capture`), the live policies (:mod:`kvsim.live`) and
the read window (:mod:`kvsim.decoding.read_window`): the stock sdpa function, a
registered attention function that hands each decoder layer's call to the handler active in
the current thread, and the attention of one decode query with a boolean keep-mask of shape
(H_kv, N), which gives exactly zero attention mass to the positions it drops; q-head ``h``
reads KV-head ``h // (H_q / H_kv)``.
"""

from __future__ import annotations

import contextvars

import torch

_REGISTERED: set[str] = set()


def stock_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_dispatching_attention(name: str, active: contextvars.ContextVar) -> str:
    """Register under ``name`` an attention function that hands every decoder layer's call to
    ``active.get().attention(module, layer, query, key, value, attention_mask, **kwargs)``, and
    runs :func:`stock_attention` when nothing is active or the module is no decoder layer (no
    ``layer_idx``: an audio encoder's attention). sdpa's mask function is registered under the
    same name, so padded inputs keep their mask (transformers routes the mask by the name).
    Idempotent; returns ``name`` (for ``attn_implementation``).
    """
    if name in _REGISTERED:
        return name
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    def dispatching_attention(module, query, key, value, attention_mask, **kwargs):
        handler = active.get()
        layer = getattr(module, "layer_idx", None)
        if handler is None or layer is None:
            return stock_attention(module, query, key, value, attention_mask, **kwargs)
        return handler.attention(module, layer, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, dispatching_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED.add(name)
    return name


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
