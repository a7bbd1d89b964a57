"""Voxtral (Mini-3B-2507, Small-24B-2507): ``VoxtralForConditionalGeneration`` + the real
``VoxtralProcessor`` (mistral-common tokenizer, WhisperFeatureExtractor).

Long-form audio is handled as Voxtral does: the processor pads audio to a multiple of 30 s and
cuts the log-mel into chunks of 3000 frames; each chunk becomes 375 audio tokens (12.5 tok/s),
so a 10 s clip still occupies 375 positions (the tail is padding).
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any

import numpy as np

from kvsim.tracer.audio import AudioClip
from kvsim.tracer.backbones.base import LANGUAGE_NAMES, Backbone, Prepared, PromptSpec

CHUNK_S = 30.0
TOKENS_PER_CHUNK = 375
#: What the trace's ``padding`` column marks for this backbone.
PADDING_RULE = ("the last 30 s window is zero-padded; its audio tokens that start at or after "
                "the end of the input are padding")


class VoxtralBackbone(Backbone):
    family = "voxtral"
    audio_tokens_per_s = TOKENS_PER_CHUNK / CHUNK_S
    sample_rate = 16000

    def _load(self) -> tuple[Any, Any]:
        from transformers import AutoProcessor, VoxtralForConditionalGeneration

        try:
            import mistral_common  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "Voxtral's processor needs mistral-common: pip install 'mistral-common[audio]'"
            ) from None
        model = VoxtralForConditionalGeneration.from_pretrained(self.path, **self.load_kwargs())
        model.to(self.options.device)
        processor = AutoProcessor.from_pretrained(self.path)
        self.processor_note = type(processor).__name__
        return model, processor

    def n_audio_tokens(self, duration_s: float) -> int:
        return max(1, math.ceil(duration_s / CHUNK_S - 1e-9)) * TOKENS_PER_CHUNK

    def _wav_base64(self, clip: AudioClip) -> str:
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, clip.samples, clip.sample_rate, format="WAV", subtype="FLOAT")
        return base64.b64encode(buf.getvalue()).decode()

    def prepare(self, clip: AudioClip, prompt: PromptSpec) -> Prepared:
        proc = self.processor
        if prompt.task == "transcribe" and prompt.text is None:
            inputs = proc.apply_transcription_request(
                audio=clip.samples, sampling_rate=clip.sample_rate, format="wav",
                language=prompt.language, model_id=self.name,
            )
        else:
            if prompt.text is not None:
                instruction = prompt.text
            else:
                target = LANGUAGE_NAMES.get(prompt.language or "en", prompt.language or "English")
                instruction = f"Translate this audio into {target}."
            conversation = [{"role": "user", "content": [
                {"type": "audio", "base64": self._wav_base64(clip)},
                {"type": "text", "text": instruction},
            ]}]
            inputs = proc.apply_chat_template(
                conversation, tokenize=True, return_dict=True, return_tensors="pt",
                add_generation_prompt=True,
            )
        dev = self.options.device
        model_dtype = next(self.model.parameters()).dtype
        batch = {k: v.to(dev) for k, v in inputs.items() if hasattr(v, "to")}
        if "input_features" in batch:
            batch["input_features"] = batch["input_features"].to(model_dtype)
        ids = inputs["input_ids"][0].cpu().numpy().astype(np.int64)
        audio_pos = np.flatnonzero(ids == self.audio_token_id)
        n_chunks = int(inputs["input_features"].shape[0]) if "input_features" in inputs else 0
        if len(audio_pos) != n_chunks * TOKENS_PER_CHUNK:
            raise RuntimeError(
                f"{len(audio_pos)} audio placeholders for {n_chunks} chunks of {TOKENS_PER_CHUNK}"
            )
        start, end = self.time_grid(len(audio_pos))
        return Prepared(
            inputs=batch,
            input_ids=ids,
            prompt_text=self.prompt_text(ids),
            kinds=self.kinds_for(ids),
            audio_positions=audio_pos,
            audio_start_s=start,
            audio_end_s=end,
            audio={"n_chunks": n_chunks, "chunk_s": CHUNK_S,
                   "padded_duration_s": n_chunks * CHUNK_S, "padding_rule": PADDING_RULE},
            audio_padding=self.padding_beyond(start, clip.duration_s),
        )
