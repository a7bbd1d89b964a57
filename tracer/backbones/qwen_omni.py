"""Qwen2.5-Omni (3B/7B) thinker: ``Qwen2_5OmniThinkerForConditionalGeneration`` + the real
``Qwen2_5OmniProcessor`` and chat template.

Audio: ``<|audio_bos|>``, ``<|AUDIO|>`` x n, ``<|audio_eos|>`` at 25 tokens/s. Long-form audio is
fed whole: the feature extractor is called with ``truncation=False`` (its default would cut at
30 s) and the audio encoder processes it in its own 2 s windows.

``Qwen2_5OmniProcessor`` cannot be constructed without torchvision (its video processor); when
torchvision is missing the adapter builds the same audio-only prompt from the checkpoint's own
tokenizer, chat template and WhisperFeatureExtractor, reproducing the processor's audio path
(``padding="max_length"``, placeholders = ``_get_feat_extract_output_lengths``) and records
which path was used in the trace's provenance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.tracer.audio import AudioClip
from kvsim.tracer.backbones.base import LANGUAGE_NAMES, Backbone, Prepared, PromptSpec

TOKENS_PER_S = 25.0
#: Qwen2_5OmniProcessor pads the log-mel to 30 s (``padding="max_length"``) but its
#: ``feature_attention_mask`` marks the real frames: the placeholders number
#: ``_get_feat_extract_output_lengths(real frames)`` and the encoder drops the padded frames
#: (``get_audio_features``), so no audio position comes from padding.
PADDING_RULE = "placeholders cover only the input's frames (feature_attention_mask): no padding"

SYSTEM_PROMPTS = {
    "transcribe": "You are a speech recognition model.",
    "translate": "You are a speech translation model.",
}


class OmniAudioProcessor:
    """Audio-only stand-in for ``Qwen2_5OmniProcessor`` (used when torchvision is missing)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
        template = None
        jinja = Path(path) / "chat_template.jinja"
        if jinja.exists():
            template = jinja.read_text()
        else:
            for name in ("chat_template.json", "processor_config.json"):
                f = Path(path) / name
                if f.exists():
                    template = json.loads(f.read_text()).get("chat_template") or template
        self.chat_template = template or self.tokenizer.chat_template
        self.audio_token = self.tokenizer.audio_token

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=False):
        return self.tokenizer.apply_chat_template(
            conversation, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=tokenize,
        )

    def __call__(self, text: str, audio: list[np.ndarray], sampling_rate: int):
        import torch
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
            _get_feat_extract_output_lengths,
        )

        feats = self.feature_extractor(
            audio, sampling_rate=sampling_rate, padding="max_length", truncation=False,
            return_attention_mask=True, return_tensors="pt",
        )
        mask = feats.pop("attention_mask")
        n_tokens = _get_feat_extract_output_lengths(mask.sum(-1))
        pieces = text.split(self.audio_token)
        if len(pieces) != len(audio) + 1:
            raise ValueError("one audio placeholder per clip expected in the prompt")
        expanded = pieces[0]
        for i, rest in enumerate(pieces[1:]):
            expanded += self.audio_token * int(n_tokens[i]) + rest
        enc = self.tokenizer(expanded, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "input_features": feats["input_features"],
                "feature_attention_mask": mask.to(torch.long)}


class QwenOmniBackbone(Backbone):
    family = "qwen-omni"
    audio_tokens_per_s = TOKENS_PER_S
    sample_rate = 16000

    def _load(self) -> tuple[Any, Any]:
        from transformers import AutoConfig, Qwen2_5OmniThinkerForConditionalGeneration

        cfg = AutoConfig.from_pretrained(self.path)
        if cfg.model_type == "qwen2_5_omni":  # full Omni checkpoint: load only its thinker
            from transformers import Qwen2_5OmniForConditionalGeneration

            kw = self.load_kwargs()
            kw["attn_implementation"] = (
                {"thinker_config": kw["attn_implementation"]}
                if isinstance(kw["attn_implementation"], dict) else kw["attn_implementation"]
            )
            full = Qwen2_5OmniForConditionalGeneration.from_pretrained(
                self.path, enable_audio_output=False, **kw)
            model = full.thinker
        else:
            model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
                self.path, **self.load_kwargs())
        model.to(self.options.device)
        try:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(self.path)
            self.processor_note = type(processor).__name__
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            processor = OmniAudioProcessor(self.path)
            self.processor_note = (
                f"OmniAudioProcessor (Qwen2_5OmniProcessor unavailable: {type(exc).__name__})"
            )
        return model, processor

    def n_audio_tokens(self, duration_s: float) -> int:
        return math.ceil(duration_s * TOKENS_PER_S)

    def prepare(self, clip: AudioClip, prompt: PromptSpec) -> Prepared:
        proc = self.processor
        if prompt.text is not None:
            instruction = prompt.text
        elif prompt.task == "translate":
            target = LANGUAGE_NAMES.get(prompt.language or "en", prompt.language or "English")
            instruction = f"Translate the audio into {target}."
        else:
            lang = LANGUAGE_NAMES.get(prompt.language or "", "")
            instruction = f"Transcribe the {lang} audio into text.".replace("  ", " ")
        conversation = [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPTS[prompt.task]}]},
            {"role": "user", "content": [{"type": "audio", "audio": str(clip.path)},
                                         {"type": "text", "text": instruction}]},
        ]
        text = proc.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        if isinstance(proc, OmniAudioProcessor):
            inputs = proc(text=text, audio=[clip.samples], sampling_rate=clip.sample_rate)
        else:
            inputs = proc(text=text, audio=[clip.samples], sampling_rate=clip.sample_rate,
                          return_tensors="pt", padding=True,
                          audio_kwargs={"truncation": False})
        dev = self.options.device
        model_dtype = next(self.model.parameters()).dtype
        batch = {k: v.to(dev) for k, v in inputs.items() if hasattr(v, "to")}
        batch["input_features"] = batch["input_features"].to(model_dtype)
        ids = inputs["input_ids"][0].cpu().numpy().astype(np.int64)
        audio_pos = np.flatnonzero(ids == self.audio_token_id)
        start, end = self.time_grid(len(audio_pos))
        return Prepared(
            inputs=batch,
            input_ids=ids,
            prompt_text=self.prompt_text(ids),
            kinds=self.kinds_for(ids, system_until=self.chatml_system_end(ids)),
            audio_positions=audio_pos,
            audio_start_s=start,
            audio_end_s=end,
            audio={"feature_frames": int(inputs["feature_attention_mask"].sum()),
                   "padding_rule": PADDING_RULE},
            audio_padding=np.zeros(len(audio_pos), dtype=bool),
        )
