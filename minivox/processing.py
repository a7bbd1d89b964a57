"""minivox processor: 16 kHz audio -> 30 s log-mel windows + chat prompt with audio tokens.

As in Voxtral, long audio is cut into 30 s windows (the last one zero-padded), each window
gives an ``(80, 3000)`` log-mel spectrogram (Whisper's feature extractor) and 375 audio
placeholder tokens; the windows' tokens are concatenated in the prompt.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import BatchFeature, WhisperFeatureExtractor

from .modeling import AUDIO_TOKENS_PER_SECOND, CHUNK_SECONDS, TOKENS_PER_CHUNK

DEFAULT_INSTRUCTION = "Transcribe the audio."


class MinivoxProcessor:
    """Feature extractor + SmolLM2 tokenizer + the transcription chat prompt.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerFast
        The SmolLM2 tokenizer.
    audio_token : str
        Placeholder string; must be a single special token of ``tokenizer``.
    """

    sampling_rate = 16000
    audio_tokens_per_second = AUDIO_TOKENS_PER_SECOND
    chunk_seconds = CHUNK_SECONDS
    tokens_per_chunk = TOKENS_PER_CHUNK

    def __init__(self, tokenizer, audio_token: str = "<empty_output>") -> None:
        self.tokenizer = tokenizer
        self.audio_token = audio_token
        ids = tokenizer.convert_tokens_to_ids([audio_token])
        if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"audio token {audio_token!r} is not in the tokenizer vocabulary")
        self.audio_token_id = int(ids[0])
        self.feature_extractor = WhisperFeatureExtractor(
            feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
        )

    # ------------------------------------------------------------------ audio
    def n_chunks(self, n_samples: int) -> int:
        """Number of 30 s windows for ``n_samples`` samples (at least 1)."""
        return max(1, math.ceil(n_samples / (self.chunk_seconds * self.sampling_rate)))

    def num_audio_tokens(self, n_samples: int) -> int:
        """Audio placeholder tokens for an input of ``n_samples`` samples."""
        return self.n_chunks(n_samples) * self.tokens_per_chunk

    def features(self, audio: np.ndarray) -> torch.Tensor:
        """``(n_chunks, 80, 3000)`` float32 log-mel windows of 16 kHz mono ``audio``."""
        audio = np.asarray(audio, dtype=np.float32)
        if audio.ndim != 1:
            raise ValueError(f"audio must be 1-D mono 16 kHz samples, got shape {audio.shape}")
        win = self.chunk_seconds * self.sampling_rate
        n = self.n_chunks(audio.size)
        padded = np.zeros(n * win, np.float32)
        padded[: audio.size] = audio
        chunks = [padded[i * win : (i + 1) * win] for i in range(n)]
        with torch.autocast("cpu", enabled=False):  # the extractor computes in torch
            feats = self.feature_extractor(
                chunks, sampling_rate=self.sampling_rate, return_tensors="np",
                padding="max_length",
            )["input_features"]
        return torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32))

    # ----------------------------------------------------------------- prompt
    def transcription_prompt(self, n_audio_tokens: int, instruction: str | None = None) -> str:
        """The chat prompt (SmolLM2 template, default system turn) with ``n`` audio tokens."""
        content = self.audio_token * n_audio_tokens + "\n" + (instruction or DEFAULT_INSTRUCTION)
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    def apply_transcription_request(self, audio: np.ndarray,
                                    instruction: str | None = None) -> BatchFeature:
        """Inputs for transcribing ``audio``: ``input_ids``, ``attention_mask``, ``input_features``."""
        return self(audio=audio, text=None, instruction=instruction)

    def __call__(self, audio: np.ndarray | None = None, text: str | None = None,
                 instruction: str | None = None, return_tensors: str = "pt",
                 **_: object) -> BatchFeature:
        """Build model inputs for one audio clip (batch size 1).

        ``text=None`` gives the transcription request. A ``text`` containing the audio token
        once is a complete prompt whose placeholder is expanded to the clip's audio tokens; a
        ``text`` without it is used as the user instruction after the audio.
        """
        if audio is None:
            if text is None:
                raise ValueError("processor needs audio, text, or both")
            enc = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)
            return BatchFeature(dict(enc))
        n_tok = self.num_audio_tokens(np.asarray(audio).size)
        if text is not None and self.audio_token in text:
            if text.count(self.audio_token) != 1:
                raise ValueError("prompt text must contain the audio token exactly once")
            prompt = text.replace(self.audio_token, self.audio_token * n_tok)
        else:
            prompt = self.transcription_prompt(n_tok, text if text is not None else instruction)
        enc = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        got = int((enc["input_ids"] == self.audio_token_id).sum())
        if got != n_tok:
            raise RuntimeError(f"tokenised prompt has {got} audio tokens, expected {n_tok}")
        return BatchFeature({
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "input_features": self.features(audio),
        })

    def decode(self, ids, **kw) -> str:
        """Decode generated ids (special tokens skipped)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, **kw).strip()

    def batch_decode(self, ids, **kw) -> list[str]:
        return [self.decode(x, **kw) for x in ids]
