"""Decode-step attention functions for transformers' attention interface (torch).

Shared by the live policies (:mod:`kvsim.live`) and minivox's read window
(:mod:`kvsim.minivox.read_window`): the stock sdpa function, and the attention of one decode
query with a boolean keep-mask of shape (H_kv, N), which gives exactly zero attention mass to
the positions it drops; q-head ``h`` reads KV-head ``h // (H_q / H_kv)``.
"""

from __future__ import annotations

import torch


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
