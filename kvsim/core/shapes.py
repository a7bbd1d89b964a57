"""The decoder's attention shape and the per-head calibration scores: what every part of kvsim
(trace format, replay, live decoding, policies) knows about a model's heads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HeadLayout:
    """Attention shape of the decoder (GQA: q-head ``h`` reads KV-head ``h // group``)."""

    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.n_layers, self.n_q_heads, self.n_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"head layout must be positive, got {self}")
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(
                f"n_q_heads={self.n_q_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def group(self) -> int:
        """GQA group size g = H_q / H_kv."""
        return self.n_q_heads // self.n_kv_heads

    @property
    def n_heads_total(self) -> int:
        """Number of (layer, KV-head) pairs, L x H_kv."""
        return self.n_layers * self.n_kv_heads


@dataclass(frozen=True)
class HeadScores:
    """Per-KV-head calibration scores (WnW §2.2, Appendix E), each of shape (L, H_kv).

    ``voice_score`` is the hit ratio VS, ``sensitivity`` the gradient norm HS.
    """

    voice_score: np.ndarray
    sensitivity: np.ndarray
    source: str = "unknown"

    def __post_init__(self) -> None:
        vs = np.asarray(self.voice_score, dtype=np.float64)
        hs = np.asarray(self.sensitivity, dtype=np.float64)
        if vs.shape != hs.shape or vs.ndim != 2:
            raise ValueError(f"voice_score {vs.shape} and sensitivity {hs.shape} must be (L, H_kv)")
        if not (np.isfinite(vs).all() and np.isfinite(hs).all()):
            raise ValueError("head scores contain NaN or inf")
        if (vs < 0).any() or (hs < 0).any():
            raise ValueError("head scores must be non-negative")
        object.__setattr__(self, "voice_score", vs)
        object.__setattr__(self, "sensitivity", hs)

    @property
    def importance(self) -> np.ndarray:
        """VS x HS, the modality-aware importance that drives WnW's triage (§2.2)."""
        return self.voice_score * self.sensitivity
