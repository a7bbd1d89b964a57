"""minivox (this project's small Voxtral-like speech LLM, ``minivox/``): loaded with
``kvsim.minivox.load_minivox`` and its ``MinivoxProcessor`` (interface: docs/minivox.md).

Audio as Voxtral: 30 s windows, 375 audio tokens each (12.5 tok/s), the last window padded.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvsim.tracer.audio import AudioClip
from kvsim.tracer.backbones.base import LANGUAGE_NAMES, Backbone, Prepared, PromptSpec, torch_dtype

CHUNK_S = 30.0
TOKENS_PER_CHUNK = 375
#: What the trace's ``padding`` column marks for this backbone.
PADDING_RULE = ("the last 30 s window is zero-padded; its audio tokens that start at or after "
                "the end of the input are padding")


class MinivoxBackbone(Backbone):
    family = "minivox"
    audio_tokens_per_s = TOKENS_PER_CHUNK / CHUNK_S
    sample_rate = 16000

    def _load(self) -> tuple[Any, Any]:
        try:
            from kvsim.minivox import load_minivox, minivox_dir
        except ImportError as exc:
            raise RuntimeError(f"minivox is not available in this checkout ({exc})") from None
        model, processor = load_minivox(
            self.path, device=self.options.device, dtype=torch_dtype(self.options.dtype),
            attn_implementation=self.attn_implementation())
        if self.path is None:
            self.path = str(minivox_dir())
        self.processor_note = type(processor).__name__
        return model, processor

    def n_audio_tokens(self, duration_s: float) -> int:
        return max(1, math.ceil(duration_s / CHUNK_S - 1e-9)) * TOKENS_PER_CHUNK

    def prepare(self, clip: AudioClip, prompt: PromptSpec) -> Prepared:
        instruction = prompt.text
        if instruction is None and prompt.task == "translate":
            target = LANGUAGE_NAMES.get(prompt.language or "en", prompt.language or "English")
            instruction = f"Translate the audio into {target}."
        inputs = self.processor(audio=clip.samples, instruction=instruction)
        model_dtype = next(self.model.parameters()).dtype
        batch = {k: v.to(self.options.device) for k, v in inputs.items()}
        batch["input_features"] = batch["input_features"].to(model_dtype)
        ids = inputs["input_ids"][0].cpu().numpy().astype(np.int64)
        audio_pos = np.flatnonzero(ids == self.audio_token_id)
        n_chunks = int(inputs["input_features"].shape[0])
        start, end = self.time_grid(len(audio_pos))
        return Prepared(
            inputs=batch, input_ids=ids, prompt_text=self.prompt_text(ids),
            kinds=self.kinds_for(ids, system_until=self.chatml_system_end(ids)),
            audio_positions=audio_pos, audio_start_s=start, audio_end_s=end,
            audio={"n_chunks": n_chunks, "chunk_s": CHUNK_S,
                   "padded_duration_s": n_chunks * CHUNK_S, "padding_rule": PADDING_RULE},
            audio_padding=self.padding_beyond(start, clip.duration_s),
        )
