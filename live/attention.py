"""The live attention function: policies applied *inside* the text decoder's attention.

A function registered with ``transformers.AttentionInterface`` under :data:`LIVE_ATTN` (and
``sdpa_mask`` under the same name in ``AttentionMaskInterface``, so padded inputs keep their
mask) receives, per decoder layer and
call, the post-RoPE ``query`` and the cached ``key``/``value``. With no active
:class:`~kvsim.live.session.LiveSession` it is exactly the stock sdpa function; with one, the
session decides per call (prefill: record the observation window and run full attention; decode:
merge the per-(layer, KV-head) keep-mask of the policy into the attention).

Eviction emulation (docs/live.md; the masked attention of :mod:`kvsim.decode_attention`): a
boolean keep-mask of shape (H_kv, N) gives exactly zero attention mass to evicted positions;
q-head ``h`` reads KV-head ``h // (H_q / H_kv)``. When nothing is masked the stock path is taken unchanged, which is the
only way to stay bit-identical to plain generation (an all-True mask switches sdpa kernels).
"""

from __future__ import annotations

import contextvars
from typing import Any

from kvsim.decode_attention import register_dispatching_attention

LIVE_ATTN = "kvsim_live"

#: The session driving the attention calls of the current thread (None: plain sdpa).
ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("kvsim_live_session", default=None)


def register_live_attention() -> str:
    """Register the live attention function and its mask function (idempotent)."""
    return register_dispatching_attention(LIVE_ATTN, ACTIVE)
