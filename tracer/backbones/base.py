"""The interface every backbone adapter implements: load a checkpoint through transformers with
the recording attention on the text decoder only, turn an audio clip into model inputs with the
model's own processor and chat template, and describe where the audio sits in the prompt."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsim.trace.schema import ModelFacts
from kvsim.tracer.audio import AudioClip, AudioError
from kvsim.tracer.capture import register_trace_attention

TASKS = ("transcribe", "translate")

LANGUAGE_NAMES = {
    "en": "English", "fr": "French", "de": "German", "es": "Spanish", "it": "Italian",
    "pt": "Portuguese", "nl": "Dutch", "hi": "Hindi", "zh": "Chinese", "ja": "Japanese",
}


@dataclass(frozen=True)
class LoadOptions:
    """How to load a backbone."""

    device: str = "cpu"
    dtype: str = "float32"  #: torch dtype name of the weights (float32, bfloat16, float16)
    trace_attention: bool = True  #: install the recording attention on the text decoder


@dataclass
class PromptSpec:
    """What to ask the model."""

    task: str = "transcribe"
    language: str | None = None  #: source language (transcribe) / target language (translate)
    text: str | None = None  #: overrides the task's default instruction


@dataclass
class Prepared:
    """Model inputs for one clip plus the layout of the prompt."""

    inputs: dict[str, torch.Tensor]
    input_ids: np.ndarray  #: (n_prompt,)
    prompt_text: str
    kinds: list[str]  #: per prompt position: system / text / audio
    audio_positions: np.ndarray  #: absolute positions of the audio placeholders
    audio_start_s: np.ndarray  #: per audio position
    audio_end_s: np.ndarray
    audio: dict[str, Any] = field(default_factory=dict)  #: duration, chunks, rate, ...
    #: per audio position: encoded from padding past the end of the input (None: unknown)
    audio_padding: np.ndarray | None = None

    @property
    def n_prompt(self) -> int:
        return len(self.input_ids)


def torch_dtype(name: str) -> torch.dtype:
    try:
        dt = getattr(torch, name)
    except AttributeError:
        dt = None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"--dtype: unknown torch dtype {name!r}")
    return dt


class Backbone(ABC):
    """One loaded model + processor. Subclasses set the class attributes and implement
    :meth:`_load` and :meth:`prepare`."""

    family: str = ""
    #: Audio tokens per second of audio (after the encoder and projector).
    audio_tokens_per_s: float = 0.0
    sample_rate: int = 16000

    def __init__(self, name: str, path: str, options: LoadOptions) -> None:
        self.name = name
        self.path = path
        self.options = options
        if options.trace_attention:
            register_trace_attention()
        self.model, self.processor = self._load()
        self.model.eval()
        self.processor_note = getattr(self, "processor_note", "")

    # ---------------------------------------------------------------- to implement
    @abstractmethod
    def _load(self) -> tuple[Any, Any]:
        """Return (model, processor) loaded from ``self.path``."""

    @abstractmethod
    def prepare(self, clip: AudioClip, prompt: PromptSpec) -> Prepared:
        """Build model inputs for ``clip`` with the real processor and chat template."""

    @abstractmethod
    def n_audio_tokens(self, duration_s: float) -> int:
        """Audio placeholders the processor will emit for a clip of this duration."""

    # ---------------------------------------------------------------- shared
    @property
    def text_config(self) -> Any:
        return self.model.config.get_text_config()

    @property
    def audio_token_id(self) -> int:
        cfg = self.model.config
        for attr in ("audio_token_id", "audio_token_index"):
            v = getattr(cfg, attr, None)
            if v is not None:
                return int(v)
        raise ValueError(f"{self.path}: config has no audio token id")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def attn_implementation(self) -> dict[str, str] | str:
        if self.options.trace_attention:
            return {"text_config": register_trace_attention()}
        return "sdpa"

    def load_kwargs(self) -> dict[str, Any]:
        return {"dtype": torch_dtype(self.options.dtype),
                "attn_implementation": self.attn_implementation()}

    def facts(self, storage_dtype: str = "float16") -> ModelFacts:
        t = self.text_config
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        return ModelFacts(
            name=self.name,
            n_layers=int(t.num_hidden_layers),
            n_q_heads=int(t.num_attention_heads),
            n_kv_heads=int(t.num_key_value_heads or t.num_attention_heads),
            head_dim=int(head_dim),
            audio_tokens_per_s=float(self.audio_tokens_per_s),
            dtype=storage_dtype,
        )

    @property
    def max_positions(self) -> int:
        return int(self.text_config.max_position_embeddings)

    def check_length(self, clip: AudioClip, max_new_tokens: int, prompt_overhead: int = 64) -> None:
        """Reject a clip whose audio + prompt + answer exceed the decoder's context."""
        n = self.n_audio_tokens(clip.duration_s)
        need = n + prompt_overhead + max_new_tokens
        if need > self.max_positions:
            raise AudioError(
                f"too long for {self.name}: {clip.duration_s:.1f} s -> {n} audio tokens "
                f"+ prompt + {max_new_tokens} new tokens > context {self.max_positions}"
            )

    def kinds_for(self, ids: np.ndarray, system_until: int = 0) -> list[str]:
        """Default position kinds: audio placeholders, special tokens and positions before
        ``system_until`` as system, everything else text."""
        special = set(self.special_ids())
        out = []
        for i, t in enumerate(ids.tolist()):
            if t == self.audio_token_id:
                out.append("audio")
            elif i < system_until or t in special:
                out.append("system")
            else:
                out.append("text")
        return out

    def prompt_text(self, ids: np.ndarray) -> str:
        """The prompt as the model saw it (special tokens kept), each run of audio placeholders
        written once with its count, e.g. ``[AUDIO]*375``."""
        audio = ids == self.audio_token_id
        out, i = [], 0
        while i < len(ids):
            j = i
            while j < len(ids) and audio[j] == audio[i]:
                j += 1
            if audio[i]:
                out.append(f"{self.decode(ids[i:i + 1], skip_special=False)}*{j - i}")
            else:
                out.append(self.decode(ids[i:j], skip_special=False))
            i = j
        return "".join(out)

    def chatml_system_end(self, ids: np.ndarray) -> int:
        """End of a leading ChatML system turn (``<|im_start|>system ... <|im_end|>`` and the
        newline after it), 0 when the prompt has none."""
        tok = self.tokenizer
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        head = self.decode(ids[:16], skip_special=False).replace("<|im_start|>", "").lstrip()
        if head.startswith("system"):
            hits = np.flatnonzero(ids == im_end)
            if len(hits):
                return int(hits[0]) + 2
        return 0

    def special_ids(self) -> list[int]:
        tok = self.tokenizer
        ids = getattr(tok, "all_special_ids", None)
        return list(ids) if ids else []

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    def decode(self, ids: list[int] | np.ndarray, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=skip_special)

    @property
    def eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, list) else {int(eos)}

    @staticmethod
    def padding_beyond(audio_start_s: np.ndarray, duration_s: float) -> np.ndarray:
        """Audio tokens that start at or after the end of the input: encoded from the zeros a
        Whisper-style processor appends to fill its last 30 s window (a token straddling the
        end holds some of the input and is not padding)."""
        return np.asarray(audio_start_s, dtype=np.float64) >= duration_s

    def time_grid(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Start/end seconds of ``n`` consecutive audio tokens at this model's rate."""
        i = np.arange(n, dtype=np.float64)
        return i / self.audio_tokens_per_s, (i + 1) / self.audio_tokens_per_s


def check_language(language: str | None) -> None:
    """ValueError ``--language CODE: ...`` (one line) unless ``language`` is None or one of the
    codes the task prompts know (:data:`LANGUAGE_NAMES`): another code would be dropped from a
    transcription prompt or pasted raw into a translation one."""
    if language is not None and language not in LANGUAGE_NAMES:
        raise ValueError(f"--language {language}: not a language code the prompts know; use one "
                         f"of {', '.join(LANGUAGE_NAMES)}")


def check_device_dtype(device: str, dtype: str) -> None:
    """Fail early, in one line, on a device or dtype this machine cannot use."""
    torch_dtype(dtype)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")


def resolve_path(path: str) -> str:
    """A local directory as is; anything else is taken as a hub id."""
    p = Path(path).expanduser()
    return str(p) if p.exists() else path
