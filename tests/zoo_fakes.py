"""Tiny in-memory PrefillView / StepView / QueryView fakes for unit tests of policies.

They hold explicit arrays so a test can hand-make the attention or keys a policy sees. A small
``drive`` loop plays the engine's role (prefill, per-layer ``select``, ``decode_step``) with
attention recomputed from queries and keys over the resident set, for policies' own tests;
the real engine is exercised in ``test_policy_invariants.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.policies.base import HeadLayout, Policy, PolicyContext, Tier


def make_ctx(
    n_layers: int = 2,
    n_q_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 8,
    n_audio: int = 100,
    seed: int = 0,
) -> PolicyContext:
    return PolicyContext(
        heads=HeadLayout(n_layers, n_q_heads, n_kv_heads, head_dim),
        n_audio=n_audio,
        audio_tokens_per_s=12.5,
        n_prefill=n_audio + 20,
        seed=seed,
    )


@dataclass
class FakePrefill:
    attention: np.ndarray  #: (L, H_q, W, T_a)
    keys: np.ndarray  #: (L, H_kv, T_a, D)
    #: results shared by the policies prefilled on this view, as the replay engine's view
    #: shares them among the runs of a pass (``kvsim.core.views.shared``); None: no sharing
    memo: dict | None = None

    @property
    def n_window(self) -> int:
        return self.attention.shape[2]

    def audio_attention(self, layer: int) -> np.ndarray:
        return self.attention[layer]

    def audio_keys(self, layer: int) -> np.ndarray:
        return self.keys[layer]


@dataclass
class FakeStep:
    step: int
    attention: np.ndarray  #: (L, H_q, T_a)

    def audio_attention(self, layer: int) -> np.ndarray:
        return self.attention[layer]


@dataclass
class FakeQuery:
    step: int
    layer: int
    q: np.ndarray  #: (H_q, D)
    keys: np.ndarray  #: (H_kv, T_a, D)

    def query(self) -> np.ndarray:
        return self.q

    def audio_keys(self) -> np.ndarray:
        return self.keys


def random_prefill(ctx: PolicyContext, n_window: int = 4, seed: int = 0) -> FakePrefill:
    """Random keys and a random row-stochastic-ish observation attention over the audio."""
    rng = np.random.default_rng(seed)
    h = ctx.heads
    logits = rng.normal(size=(h.n_layers, h.n_q_heads, n_window, ctx.n_audio)) * 2.0
    att = np.exp(logits)
    att /= att.sum(axis=-1, keepdims=True) * 1.25  # 20% of the mass sits on non-audio columns
    keys = rng.normal(size=(h.n_layers, h.n_kv_heads, ctx.n_audio, h.head_dim))
    return FakePrefill(att.astype(np.float32), keys.astype(np.float32))


def split_window_prefill(n_audio: int = 40) -> FakePrefill:
    """One layer, two q-heads, five window queries: the first three put their attention on
    audio positions 0-4, the last two on 30-34 (which queries a policy's ``window`` reads)."""
    att = np.zeros((1, 2, 5, n_audio), dtype=np.float32)
    att[:, :, :3, 0:5] = 1.0
    att[:, :, 3:, 30:35] = 1.0
    return FakePrefill(att, np.zeros((1, 1, n_audio, 8), np.float32))


@dataclass
class DriveLog:
    tiers: list[np.ndarray] = field(default_factory=list)  #: after prefill, after each step
    reads: list[np.ndarray] = field(default_factory=list)  #: (L, H_kv, T_a) read masks per step


def drive(
    policy: Policy, ctx: PolicyContext, prefill: FakePrefill, n_steps: int, seed: int = 1
) -> DriveLog:
    """Minimal engine: random decode queries, attention over what is resident/selected."""
    rng = np.random.default_rng(seed)
    h = ctx.heads
    log = DriveLog()
    tiers = np.asarray(policy.prefill(ctx, prefill)).copy()
    log.tiers.append(tiers.copy())
    for step in range(n_steps):
        att = np.zeros((h.n_layers, h.n_q_heads, ctx.n_audio), dtype=np.float32)
        reads = np.zeros(tiers.shape, dtype=bool)
        for layer in range(h.n_layers):
            q = rng.normal(size=(h.n_q_heads, h.head_dim)).astype(np.float32)
            mask = None
            if policy.query_aware:
                mask = policy.select(FakeQuery(step, layer, q, prefill.keys[layer]))
                cur = policy.current_tiers()
                if cur is not None:
                    tiers = np.asarray(cur).copy()
            gpu = tiers[layer] == Tier.GPU
            read = gpu if mask is None else np.asarray(mask, dtype=bool)
            assert not (read & ~gpu).any(), "select read a non-GPU position"
            reads[layer] = read
            keys = prefill.keys[layer][np.arange(h.n_q_heads) // h.group]  # (H_q, T_a, D)
            logits = np.einsum("hd,htd->ht", q, keys) / np.sqrt(h.head_dim)
            rq = read[np.arange(h.n_q_heads) // h.group]
            w = np.where(rq, np.exp(logits - logits.max()), 0.0)
            att[layer] = w / (w.sum(axis=-1, keepdims=True) + 1.0)  # + non-audio mass
        log.reads.append(reads)
        new = policy.decode_step(FakeStep(step, att))
        if new is not None:
            tiers = np.asarray(new).copy()
        log.tiers.append(tiers.copy())
    return log
