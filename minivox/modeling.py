"""minivox: Whisper tiny.en encoder -> 4-frame-stacking MLP projector -> SmolLM2-135M.

minivox *is* a Voxtral in miniature, so it reuses transformers' Voxtral classes verbatim:
``MinivoxForConditionalGeneration`` subclasses ``VoxtralForConditionalGeneration`` (audio
tower = Whisper-style encoder, ``multi_modal_projector`` = Linear(4*384 -> 576) + GELU +
Linear(576 -> 576), ``language_model`` = stock ``LlamaModel``, separate ``lm_head``). Every
30 s window yields 1500 encoder frames, stacked by 4 into 375 audio tokens (12.5 tokens/s);
windows are concatenated along the sequence, exactly as Voxtral does.
"""

from __future__ import annotations

import contextlib

from huggingface_hub.dataclasses import strict
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSpeechSeq2Seq,
    LlamaConfig,
    VoxtralConfig,
    VoxtralEncoderConfig,
    VoxtralForConditionalGeneration,
)

# Whisper tiny.en encoder geometry.
WHISPER_TINY_ENCODER = dict(
    vocab_size=51864,
    hidden_size=384,
    intermediate_size=1536,  # == 4 * 384: Voxtral's projector reshapes by this, i.e. stacks 4 frames
    num_hidden_layers=4,
    num_attention_heads=6,
    num_mel_bins=80,
    max_source_positions=1500,
    activation_function="gelu",
)

#: Seconds of audio per encoder window and audio tokens per window (1500 frames / 4).
CHUNK_SECONDS = 30
TOKENS_PER_CHUNK = 375
AUDIO_TOKENS_PER_SECOND = TOKENS_PER_CHUNK / CHUNK_SECONDS  # 12.5


@strict
class MinivoxConfig(VoxtralConfig):
    """Configuration of minivox (a ``VoxtralConfig`` with its own ``model_type``).

    Extra fields: ``audio_token`` (the placeholder string), ``sampling_rate``,
    ``audio_tokens_per_second``.
    """

    model_type = "minivox"
    audio_token: str = "<empty_output>"
    sampling_rate: int = 16000
    audio_tokens_per_second: float = AUDIO_TOKENS_PER_SECOND


class MinivoxForConditionalGeneration(VoxtralForConditionalGeneration):
    """minivox for generation (see module docstring). Decoder: ``self.model.language_model``."""

    config_class = MinivoxConfig
    config: MinivoxConfig


def register() -> None:
    """Register minivox with the transformers Auto classes (idempotent)."""
    with contextlib.suppress(ValueError):
        AutoConfig.register("minivox", MinivoxConfig)
    for auto in (AutoModel, AutoModelForSpeechSeq2Seq):
        with contextlib.suppress(ValueError):
            auto.register(MinivoxConfig, MinivoxForConditionalGeneration)


def build_config(text_config: LlamaConfig, audio_token_id: int, audio_token: str) -> MinivoxConfig:
    """minivox config from the SmolLM2 Llama config and the chosen placeholder token."""
    audio_cfg = VoxtralEncoderConfig(**WHISPER_TINY_ENCODER)
    cfg = MinivoxConfig(
        audio_config=audio_cfg,
        text_config=text_config,
        audio_token_id=audio_token_id,
        audio_token=audio_token,
        projector_hidden_act="gelu",
    )
    cfg.tie_word_embeddings = False
    return cfg


register()
