"""Tiny hand-made PrefillView / StepView / PolicyContext for zoo-a policy unit tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.policies.base import HeadLayout, HeadScores, PolicyContext


@dataclass
class FakePrefillView:
    """Prefill view over a given (L, H_q, W, T_a) attention array."""

    att: np.ndarray
    keys: np.ndarray | None = None

    @property
    def n_window(self) -> int:
        return self.att.shape[2]

    def audio_attention(self, layer: int) -> np.ndarray:
        return self.att[layer].astype(np.float32)

    def audio_keys(self, layer: int) -> np.ndarray:
        if self.keys is None:
            raise AttributeError("no keys in this fake view")
        return self.keys[layer]


@dataclass
class FakeStepView:
    """Step view over a given (L, H_q, T_a) attention array; records which layers were read."""

    step: int
    att: np.ndarray
    read: list[int] = field(default_factory=list)

    def audio_attention(self, layer: int) -> np.ndarray:
        self.read.append(layer)
        return self.att[layer].astype(np.float32)


def make_ctx(
    n_layers: int = 2,
    n_q: int = 4,
    n_kv: int = 2,
    n_audio: int = 100,
    tokens_per_s: float = 12.5,
    voice_score: np.ndarray | None = None,
    sensitivity: np.ndarray | None = None,
    head_dim: int = 8,
) -> PolicyContext:
    scores = None
    if voice_score is not None or sensitivity is not None:
        shape = (n_layers, n_kv)
        vs = np.ones(shape) if voice_score is None else np.asarray(voice_score, float)
        hs = np.ones(shape) if sensitivity is None else np.asarray(sensitivity, float)
        scores = HeadScores(vs.reshape(shape), hs.reshape(shape), source="test")
    return PolicyContext(
        heads=HeadLayout(n_layers, n_q, n_kv, head_dim),
        n_audio=n_audio,
        audio_tokens_per_s=tokens_per_s,
        n_prefill=n_audio + 10,
        head_scores=scores,
    )


def random_prefill(ctx: PolicyContext, n_window: int = 4, seed: int = 0) -> FakePrefillView:
    """Softmax-like random attention rows (each row sums to 0.8 over the audio)."""
    rng = np.random.default_rng(seed)
    shape = (ctx.heads.n_layers, ctx.heads.n_q_heads, n_window, ctx.n_audio)
    logits = rng.normal(size=shape) * 2.0
    att = np.exp(logits)
    att = 0.8 * att / att.sum(-1, keepdims=True)
    return FakePrefillView(att)


def focused_step(ctx: PolicyContext, step: int, lo: int, hi: int) -> FakeStepView:
    """Every q-head puts all its audio attention uniformly on audio positions [lo, hi)."""
    att = np.zeros((ctx.heads.n_layers, ctx.heads.n_q_heads, ctx.n_audio))
    att[..., lo:hi] = 1.0 / (hi - lo)
    return FakeStepView(step, att)
