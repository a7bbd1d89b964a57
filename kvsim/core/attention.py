"""Exact attention recomputed from recorded post-RoPE queries and keys.

softmax(q Kᵀ / √d) with a causal mask and GQA (q-head ``h`` reads KV-head ``h // g``), in
float32. These are the only attention kernels of the replay engine and of the studies, so a
test that pins them against a direct recomputation covers both.
"""

from __future__ import annotations

import numpy as np


def gqa_logits(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Scaled logits of queries against keys with grouped-query attention.

    Parameters
    ----------
    q : (H_q, D) or (H_q, M, D) float32
    keys : (H_kv, N, D) float32

    Returns
    -------
    (H_q, N) or (H_q, M, N) float32 logits ``q·kᵀ/√D``.
    """
    h_kv, _, d = keys.shape
    h_q = q.shape[0]
    g = h_q // h_kv
    scale = np.float32(1.0 / np.sqrt(d))
    # scaled in place (the same float32 products as ``out * scale``, without a second array
    # as large as the logits)
    if q.ndim == 2:
        qg = q.reshape(h_kv, g, d)
        out = np.matmul(qg, keys.transpose(0, 2, 1))  # (H_kv, g, N)
        out *= scale
        return out.reshape(h_q, -1)
    m = q.shape[1]
    qg = q.reshape(h_kv, g * m, d)
    out = np.matmul(qg, keys.transpose(0, 2, 1))  # (H_kv, g*M, N)
    out *= scale
    return out.reshape(h_q, m, -1)


def softmax_(x: np.ndarray) -> np.ndarray:
    """In-place numerically stable softmax over the last axis; returns ``x``."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def decode_attention_block(queries: np.ndarray, keys: np.ndarray,
                           positions: np.ndarray) -> np.ndarray:
    """Full attention of the queries of consecutive decode positions, each over the keys up to
    its own position, from one matrix product.

    Replay is open loop (the recorded queries do not depend on the policy), so the queries of
    B steps can share one ``q·Kᵀ``: the keys are read once for B steps instead of once per
    step. A one-query product per step is bound by reading the keys (a few rows per KV-head
    against all of them); B queries tall, it runs several times faster. A row's logits then
    come from a product B queries tall, so they may differ in the last bit from a one-query
    product (BLAS kernels tile by the product's shape); with B = 1 this is the per-step
    computation, bit for bit.

    Parameters
    ----------
    queries : (H_q, B, D) float32, C-contiguous
        The queries of positions ``positions``.
    keys : (H_kv, N, D) float32
        Keys, ``N > positions[-1]``.
    positions : (B,) int
        Absolute positions, ascending.

    Returns
    -------
    (H_q, B, n) float32, ``n = positions[-1] + 1``: row ``b`` of every q-head is the softmax
    over positions ``[0, positions[b]]``; the entries after ``positions[b]`` are not defined.
    """
    logits = gqa_logits(queries, keys[:, : int(positions[-1]) + 1])
    for b, position in enumerate(positions):
        softmax_(logits[:, b, : int(position) + 1])
    return logits


def causal_attention(q: np.ndarray, keys: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """Full attention of queries at absolute ``q_positions`` over ``keys[:, :max+1]``.

    Returns (H_q, M, N) probabilities with zeros beyond each query's own position.
    """
    n = int(q_positions.max()) + 1
    logits = gqa_logits(q, keys[:, :n])
    future = np.arange(n)[None, :] > np.asarray(q_positions)[:, None]  # (M, N)
    logits[:, future] = -np.inf
    return softmax_(logits)


def causal_attention_columns(q: np.ndarray, keys: np.ndarray, q_positions: np.ndarray,
                             columns: np.ndarray) -> np.ndarray:
    """``causal_attention(q, keys, q_positions)[:, :, columns]``, bit for bit, computed one
    KV-head at a time.

    The whole-layer attention (H_q, M, N) is never formed: at most one KV-head's, (g, M, N),
    exists beside the (H_q, M, len(columns)) result. Each KV-head's logits are the same matrix
    product of the same operands as in the stacked product, and softmax works row by row.
    """
    h_kv = keys.shape[0]
    g = q.shape[0] // h_kv
    out = np.empty((q.shape[0], q.shape[1], len(columns)), dtype=np.float32)
    for head in range(h_kv):
        rows = slice(head * g, (head + 1) * g)
        out[rows] = causal_attention(q[rows], keys[head : head + 1], q_positions)[:, :, columns]
    return out


def as_f32(a: np.ndarray) -> np.ndarray:
    """A float32 copy (or view if already float32) of a stored tensor."""
    return np.asarray(a, dtype=np.float32)
