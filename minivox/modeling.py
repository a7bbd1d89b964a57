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

import torch
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

from kvsim.whisper import WHISPER_MODELS

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

# Whisper base's encoder (OpenAI Whisper base, multilingual; kvsim.whisper.whisper_base_dir):
# the same layers, wider and deeper. Its conversion matches CTranslate2's encoder as tiny.en's does.
WHISPER_BASE_ENCODER = dict(WHISPER_TINY_ENCODER, hidden_size=512, intermediate_size=2048,
                            num_hidden_layers=6, num_attention_heads=8)
#: The Whisper encoders minivox can convert, by kvsim.whisper's model names.
WHISPER_ENCODERS = dict(zip(WHISPER_MODELS, (WHISPER_TINY_ENCODER, WHISPER_BASE_ENCODER), strict=True))
#: The shipped model's encoder, and that of every build or adapter that names none (all of
#: those from before the encoder was recorded).
DEFAULT_ENCODER = "tiny.en"

#: Seconds of audio per encoder window and audio tokens per window (1500 frames / 4).
CHUNK_SECONDS = 30
TOKENS_PER_CHUNK = 375
AUDIO_TOKENS_PER_SECOND = TOKENS_PER_CHUNK / CHUNK_SECONDS  # 12.5


@strict
class MinivoxConfig(VoxtralConfig):
    """Configuration of minivox (a ``VoxtralConfig`` with its own ``model_type``).

    Extra fields: ``audio_token`` (the placeholder string), ``sampling_rate``,
    ``audio_tokens_per_second``, ``whisper_encoder`` (the :data:`WHISPER_ENCODERS` name of the
    audio encoder; tiny.en in builds from before the field existed).
    """

    model_type = "minivox"
    audio_token: str = "<empty_output>"
    sampling_rate: int = 16000
    audio_tokens_per_second: float = AUDIO_TOKENS_PER_SECOND
    whisper_encoder: str = DEFAULT_ENCODER


class MinivoxForConditionalGeneration(VoxtralForConditionalGeneration):
    """minivox for generation (see module docstring). Decoder: ``self.model.language_model``."""

    config_class = MinivoxConfig
    config: MinivoxConfig

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False,
                                      input_ids: torch.LongTensor | None = None, **model_kwargs):
        """transformers' expansion for beam search and ``num_return_sequences``, with each
        row's audio windows copied as one group (:func:`expand_audio_windows`)."""
        features = model_kwargs.pop("input_features", None)
        if features is not None and expand_size > 1:
            audio = self.config.audio_config  # encoder frames per window, stacked by the projector
            per_window = audio.max_source_positions * audio.hidden_size // audio.intermediate_size
            features = expand_audio_windows(features, input_ids, self.config.audio_token_id,
                                            per_window, expand_size)
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size, is_encoder_decoder, input_ids, **model_kwargs)
        if features is not None:
            model_kwargs["input_features"] = features
        return input_ids, model_kwargs


def expand_audio_windows(features: torch.Tensor, input_ids: torch.Tensor | None,
                         audio_token_id: int, tokens_per_window: int,
                         expand_size: int) -> torch.Tensor:
    """``features`` (windows of every row, row after row) for ``input_ids`` with each row
    repeated ``expand_size`` times: row r's group of windows copied whole.

    transformers' generic expansion (``repeat_interleave`` on every tensor) interleaves single
    windows instead ([w0, w0, w1, w1] for one row of two windows), which gives a beam the audio
    of the wrong windows, silently, whenever a clip is longer than one window (the audio
    embeddings fill the placeholders in row-major order). Each row's window count is its
    placeholder count over ``tokens_per_window``; a mismatch raises ValueError.
    """
    if input_ids is None:
        raise ValueError("beam search over audio needs input_ids (the audio placeholders)")
    per_row = (input_ids == audio_token_id).sum(-1)
    windows = per_row // tokens_per_window
    if (per_row % tokens_per_window).any() or int(windows.sum()) != features.shape[0]:
        raise ValueError(f"input_features has {features.shape[0]} windows, input_ids "
                         f"{int(per_row.sum())} audio tokens ({tokens_per_window} per window)")
    groups = torch.split(features, windows.tolist())
    return torch.cat([g for g in groups for _ in range(expand_size)])


def register() -> None:
    """Register minivox with the transformers Auto classes (idempotent)."""
    with contextlib.suppress(ValueError):
        AutoConfig.register("minivox", MinivoxConfig)
    for auto in (AutoModel, AutoModelForSpeechSeq2Seq):
        with contextlib.suppress(ValueError):
            auto.register(MinivoxConfig, MinivoxForConditionalGeneration)


def build_config(text_config: LlamaConfig, audio_token_id: int, audio_token: str,
                 encoder: str = DEFAULT_ENCODER) -> MinivoxConfig:
    """minivox config from the SmolLM2 Llama config, the chosen placeholder token and the
    Whisper encoder (:data:`WHISPER_ENCODERS`; the projector stacks 4 of its frames)."""
    if encoder not in WHISPER_ENCODERS:
        raise ValueError(f"unknown Whisper encoder {encoder!r}: one of {', '.join(WHISPER_ENCODERS)}")
    audio_cfg = VoxtralEncoderConfig(**WHISPER_ENCODERS[encoder])
    cfg = MinivoxConfig(
        audio_config=audio_cfg,
        text_config=text_config,
        audio_token_id=audio_token_id,
        audio_token=audio_token,
        projector_hidden_act="gelu",
        whisper_encoder=encoder,
    )
    cfg.tie_word_embeddings = False
    return cfg


register()
