"""Backbones live decoding can drive: what a model must provide (a prompt with an audio span,
its input embeddings, EOS ids, head layout) and two implementations:

* ``tiny`` -- a random-weight ``LlamaForCausalLM`` whose "audio" positions carry a fixed random
  projection of log-energy frames of the waveform (12.5 frames/s). Deterministic from its seed;
  used by the tests and for smoke runs on any machine. Its transcripts are meaningless.
* any backbone of :mod:`kvsim.tracer.backbones` (``minivox``, Voxtral, Qwen2.5-Omni thinker, or a local
  checkpoint directory), with its real processor and chat template.

Both are loaded with the live attention (:data:`kvsim.live.attention.LIVE_ATTN`) on the text
decoder only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvsim.core.shapes import HeadLayout
from kvsim.live.attention import register_live_attention


@dataclass
class LivePrompt:
    """Model inputs of one clip plus the layout of its prompt."""

    model_inputs: dict[str, torch.Tensor]  #: what plain ``generate`` takes
    n_prompt: int
    audio_positions: np.ndarray  #: absolute positions of the audio span (sorted, contiguous)
    audio_start_s: np.ndarray
    audio_end_s: np.ndarray
    duration_s: float
    #: (1, T, H) prompt embeddings when an input transform rewrote the audio span; the prefill
    #: then runs from ``inputs_embeds``.
    inputs_embeds: torch.Tensor | None = None
    transform: str = "none"
    original_n_audio: int = 0
    span_kinds: list[str] = field(default_factory=list)  #: per audio-span position: audio / anchor
    #: in-layer AffPool (WnW App. F) applied during prefill, a
    #: :class:`kvsim.tracer.transforms.affpool_layers.LayerPoolConfig`; None: no pooling
    layer_pool: Any = None
    #: per audio position: encoded from the zeros a Whisper-style processor appends to fill its
    #: last 30 s window (None: the backbone does not say)
    audio_padding: np.ndarray | None = None

    @property
    def n_audio(self) -> int:
        return len(self.audio_positions)

    def prefill_inputs(self) -> dict[str, torch.Tensor]:
        if self.inputs_embeds is not None:
            return {"inputs_embeds": self.inputs_embeds}
        return dict(self.model_inputs)


class LiveModel(ABC):
    """A loaded backbone for live decoding."""

    name: str = ""
    audio_tokens_per_s: float = 12.5
    sample_rate: int = 16000

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None

    @abstractmethod
    def prepare(self, audio: np.ndarray, instruction: str | None = None, task: str = "transcribe",
                language: str | None = None) -> LivePrompt:
        """Prompt for one 16 kHz mono clip (``task``: transcribe | translate into ``language``)."""

    @abstractmethod
    def embed(self, prompt: LivePrompt) -> torch.Tensor:
        """The decoder's input embeddings of ``prompt`` (1, T, H), audio span included."""

    @abstractmethod
    def text_embeddings(self, text: str) -> torch.Tensor:
        """Embeddings (n_tokens, H) of ``text`` tokenised without special tokens."""

    @property
    def text_config(self) -> Any:
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def layout(self) -> HeadLayout:
        t = self.text_config
        hd = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        return HeadLayout(int(t.num_hidden_layers), int(t.num_attention_heads),
                          int(t.num_key_value_heads or t.num_attention_heads), int(hd))

    @property
    def eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype_bytes(self) -> int:
        return next(self.model.parameters()).element_size()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- tiny
@dataclass(frozen=True)
class TinyConfig:
    """Shape of the random tiny backbone."""

    n_layers: int = 2
    n_q_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 96
    seed: int = 0
    prefix_tokens: int = 5  #: system/user tokens before the audio
    window_tokens: int = 6  #: instruction tokens after the audio (observation window)


class _ByteTokenizer:
    """Characters -> ids (printable ASCII), enough for the tiny backbone's outputs."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4 + (ord(c) - 32) % (self.vocab - 4) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (int(i) - 4) % 95) for i in ids if int(i) >= 4)


class TinyBackbone(LiveModel):
    """Random-weight Llama with a fake audio front end (see module docstring)."""

    name = "tiny"

    def __init__(self, cfg: TinyConfig | None = None, device: str = "cpu") -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.cfg = cfg = cfg or TinyConfig()
        torch.manual_seed(cfg.seed)
        hidden = cfg.n_q_heads * cfg.head_dim
        config = LlamaConfig(
            vocab_size=cfg.vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_q_heads,
            num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        config._attn_implementation = register_live_attention()
        self.model = LlamaForCausalLM(config).eval().to(device)
        self.model.generation_config.eos_token_id = 2
        self.model.generation_config.pad_token_id = 0
        self.tokenizer = _ByteTokenizer(cfg.vocab)
        g = torch.Generator().manual_seed(cfg.seed + 1)
        self.frame_proj = torch.randn(8, hidden, generator=g) / 8**0.5
        self.audio_token_id = 3

    def _frames(self, audio: np.ndarray) -> torch.Tensor:
        hop = int(self.sample_rate / self.audio_tokens_per_s)
        n = max(1, int(np.ceil(len(audio) / hop)))
        padded = np.zeros(n * hop, dtype=np.float32)
        padded[: len(audio)] = audio
        fr = padded.reshape(n, 8, hop // 8)
        feats = np.log1p(100 * (fr**2).mean(-1))  # (n, 8) log energy of 8 sub-frames
        return torch.as_tensor(feats, dtype=torch.float32)

    def prepare(self, audio: np.ndarray, instruction: str | None = None, task: str = "transcribe",
                language: str | None = None) -> LivePrompt:
        c = self.cfg
        feats = self._frames(np.asarray(audio, dtype=np.float32))
        n_a = feats.shape[0]
        prefix = [1] + [5 + i for i in range(c.prefix_tokens - 1)]
        window = self.tokenizer.encode((instruction or "Transcribe")[: c.window_tokens].ljust(c.window_tokens))
        ids = prefix + [self.audio_token_id] * n_a + window
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        prompt = LivePrompt(
            model_inputs={"input_ids": input_ids},
            n_prompt=len(ids),
            audio_positions=np.arange(len(prefix), len(prefix) + n_a),
            audio_start_s=np.arange(n_a) / self.audio_tokens_per_s,
            audio_end_s=(np.arange(n_a) + 1) / self.audio_tokens_per_s,
            duration_s=len(audio) / self.sample_rate,
            original_n_audio=n_a,
            span_kinds=["audio"] * n_a,
            audio_padding=np.zeros(n_a, dtype=bool),  # frames cover the input only
        )
        prompt.model_inputs = {"inputs_embeds": self._embed_ids(input_ids, feats)}
        return prompt

    def _embed_ids(self, input_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        emb = self.model.get_input_embeddings()(input_ids)
        audio = (feats @ self.frame_proj).to(emb.device, emb.dtype)
        mask = input_ids[0] == self.audio_token_id
        emb = emb.clone()
        emb[0, mask] = emb[0, mask] + audio
        return emb.detach()

    def embed(self, prompt: LivePrompt) -> torch.Tensor:
        return prompt.model_inputs["inputs_embeds"]

    def text_embeddings(self, text: str) -> torch.Tensor:
        ids = torch.tensor(self.tokenizer.encode(text), dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings()(ids).detach()


# ----------------------------------------------------------------------------- tracer backbones
class TracerLive(LiveModel):
    """Any backbone of :mod:`kvsim.tracer.backbones` (minivox, Voxtral, Qwen2.5-Omni thinker), loaded
    with its own processor and chat template, the live attention on its text decoder."""

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32") -> None:
        super().__init__()
        from kvsim.tracer.backbones import BackboneError, LoadOptions, load_backbone

        try:
            self.bb = load_backbone(model, LoadOptions(device=device, dtype=dtype, trace_attention=False))
        except BackboneError as exc:
            raise ValueError(str(exc)) from None
        self.bb.model.set_attn_implementation({"text_config": register_live_attention()})
        self.model = self.bb.model
        self.tokenizer = self.bb.tokenizer
        self.name = self.bb.name
        self.family = self.bb.family
        self.audio_tokens_per_s = float(self.bb.audio_tokens_per_s)
        self.sample_rate = int(self.bb.sample_rate)

    def prepare(self, audio: np.ndarray, instruction: str | None = None, task: str = "transcribe",
                language: str | None = None) -> LivePrompt:
        from pathlib import Path

        from kvsim.tracer.audio import AudioClip
        from kvsim.tracer.backbones import PromptSpec

        clip = AudioClip(Path("<memory>"), np.asarray(audio, dtype=np.float32), self.sample_rate,
                         self.sample_rate, 1)
        prep = self.bb.prepare(clip, PromptSpec(task=task, language=language, text=instruction))
        n_a = len(prep.audio_positions)
        return LivePrompt(
            model_inputs=dict(prep.inputs), n_prompt=prep.n_prompt,
            audio_positions=np.asarray(prep.audio_positions, dtype=np.int64),
            audio_start_s=np.asarray(prep.audio_start_s, dtype=np.float64),
            audio_end_s=np.asarray(prep.audio_end_s, dtype=np.float64),
            duration_s=clip.duration_s, original_n_audio=n_a, span_kinds=["audio"] * n_a,
            audio_padding=None if prep.audio_padding is None else np.asarray(prep.audio_padding, dtype=bool),
        )

    @torch.no_grad()
    def embed(self, prompt: LivePrompt) -> torch.Tensor:
        if self.family not in ("voxtral", "minivox"):
            raise ValueError(f"{self.name}: input transforms support Voxtral-family backbones only")
        m = self.model
        ids = prompt.model_inputs["input_ids"]
        emb = m.get_input_embeddings()(ids)
        audio = m.get_audio_features(prompt.model_inputs["input_features"], return_dict=True).pooler_output
        mask = (ids == self.bb.audio_token_id).unsqueeze(-1).expand_as(emb)
        return emb.masked_scatter(mask, audio.to(emb.dtype))

    def text_embeddings(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        return self.model.get_input_embeddings()(ids.to(self.device)).detach()

    def decode(self, ids: list[int]) -> str:
        return self.bb.decode(ids)


def load_backbone(name: str, device: str = "cpu", dtype: str = "float32") -> LiveModel:
    """``tiny`` | ``tiny:<seed>`` (random test backbone), or any ``--model`` of ``kvsim trace``
    (``minivox``, ``voxtral-mini``, ``qwen-omni``, a local checkpoint directory)."""
    kind, _, arg = name.partition(":")
    if kind == "tiny":
        return TinyBackbone(TinyConfig(seed=int(arg) if arg else 0), device=device)
    return TracerLive(name, device=device, dtype=dtype)
