"""Attention shapes of the backbones kvsim knows (decoder self-attention only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackboneShape:
    """Decoder attention shape and audio token rate of a speech LLM."""

    name: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    audio_tokens_per_s: float
    source: str

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K+V bytes of one position over all layers and KV-heads."""
        return self.n_layers * self.n_kv_heads * self.head_dim * 2 * dtype_bytes


SHAPES: dict[str, BackboneShape] = {
    s.name: s
    for s in (
        BackboneShape("voxtral-mini", 30, 32, 8, 128, 12.5,
                      "Voxtral-mini-3b-2507 text decoder (WnW §2 Notation)"),
        BackboneShape("qwen-omni", 36, 16, 2, 128, 25.0,
                      "Qwen2.5-Omni-3B thinker (WnW §2 Notation)"),
        BackboneShape("minivox", 30, 9, 3, 64, 12.5,
                      "SmolLM2-135M decoder behind a Whisper tiny.en encoder (issue 6)"),
        BackboneShape("small", 4, 8, 2, 32, 12.5, "small test shape"),
        BackboneShape("tiny", 2, 4, 2, 16, 12.5, "tiny test shape"),
    )
}


def get_shape(name: str) -> BackboneShape:
    if name not in SHAPES:
        raise KeyError(f"unknown backbone shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]
