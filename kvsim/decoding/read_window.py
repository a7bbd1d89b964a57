"""Read window: greedy decoding that keeps a speech LLM's aligning layers reading the audio in order.

A decoding option of ``kvsim live`` and of :mod:`kvsim.minivox.evaluate` (``--read-window``),
not the papers' protocol (plain greedy decoding). Every key stays in the cache and every
decoder layer but the aligning ones reads all of it (or what a KV policy keeps); the aligning
layers (minivox's 20-23, where its attention follows the words) read only the audio inside a
window around the current read position, the way inference-time attention windows keep
text-to-speech decoders from skipping and repeating (Tacotron-style windowed attention).

The read position is where the aligning layers attend: after each decoded token, the peak of
their head-mean attention over the audio, summed over the layers. It only moves forward.
When it has not moved for ``stall_tokens`` tokens in a row the model is writing without
reading (minivox's loops re-read the same seconds: docs/minivox.md, "Where the long-form
errors are"), so the position steps one audio token forward and the audio behind it leaves
the window for good. Once that step leaves the audio, decoding stops: there is nothing left to
read.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvsim.decode_attention import (
    masked_attention_probs,
    masked_decode_attention,
    register_dispatching_attention,
    stock_attention,
)
from kvsim.decoding.option_spec import parse_comma_option

#: The name the read-window attention function is registered under.
READ_WINDOW_ATTN = "minivox_read_window"

#: The window driving the attention calls of the current thread (None: plain sdpa).
ACTIVE: contextvars.ContextVar[ReadWindow | None] = contextvars.ContextVar(
    "minivox_read_window", default=None)


#: minivox's aligning decoder layers (the default of :class:`ReadWindowConfig`)
MINIVOX_ALIGNING_LAYERS = (20, 21, 22, 23)


@dataclass(frozen=True)
class ReadWindowConfig:
    """The window's shape.

    Parameters
    ----------
    behind_s, ahead_s
        Seconds of audio the aligning layers may read behind and ahead of the read position.
    stall_tokens
        Decoded tokens without a forward move of the read position after which it is pushed
        one audio token forward.
    layers
        The aligning decoder layers: by default minivox's 20-23, whose attention peak follows
        the word being written (the guided loss's default layers, docs/minivox.md
        "Training"); another model needs its own.
    others_s
        A diagnostic (default: off, ``(inf, inf)``): seconds of audio every *other* decoder
        layer may read behind and ahead of the read position at a decode step. Measured on
        minivox, any limit costs WER: the other layers read the whole clip
        (docs/minivox.md, "The other layers need all of the audio").
    """

    behind_s: float = 2.0
    ahead_s: float = 3.0
    stall_tokens: int = 8
    layers: tuple[int, ...] = MINIVOX_ALIGNING_LAYERS
    others_s: tuple[float, float] = (math.inf, math.inf)

    def __post_init__(self) -> None:
        if not (0 <= self.behind_s < math.inf and 0 < self.ahead_s < math.inf):
            raise ValueError(f"read window: behind {self.behind_s} s must be >= 0 and ahead "
                             f"{self.ahead_s} s > 0")
        if self.stall_tokens < 1:
            raise ValueError(f"read window: stall {self.stall_tokens} tokens must be >= 1")
        if not self.layers or min(self.layers) < 0:
            raise ValueError(f"read window: aligning layers {self.layers} must be given, each >= 0")
        if len(self.others_s) != 2 or not (self.others_s[0] >= 0 and self.others_s[1] > 0):
            raise ValueError(f"read window: the other layers' reach {self.others_s} must be "
                             "(behind >= 0, ahead > 0) seconds")

    @property
    def limits_others(self) -> bool:
        """The other decoder layers read less than all of the audio (the diagnostic is on)."""
        return self.others_s != (math.inf, math.inf)

    @classmethod
    def parse(cls, spec: str) -> ReadWindowConfig:
        """``"BEHIND,AHEAD,STALL[,LAYERS]"`` (seconds, seconds, tokens, the aligning layers as
        ranges joined by ``+``: ``20-23``, ``4+9-11``; default minivox's), e.g. ``"2,3,8"``."""
        types = (float, float, int, parse_layers)[: 4 if spec.count(",") == 3 else 3]
        return parse_comma_option(cls, spec, "--read-window",
                                  "BEHIND,AHEAD,STALL[,LAYERS] (e.g. 2,3,8 or 2,3,8,20-23)", types)

    def check_layers(self, n_layers: int, model: str) -> None:
        """ValueError when an aligning layer is not one of ``model``'s ``n_layers`` decoder layers."""
        if max(self.layers) >= n_layers:
            raise ValueError(f"read window: aligning layer {max(self.layers)} of a {n_layers}-layer "
                             f"decoder ({model}); give its aligning layers: --read-window "
                             f"{self.behind_s:g},{self.ahead_s:g},{self.stall_tokens},FIRST-LAST")

    def spec(self) -> str:
        """The ``--read-window`` value that gives this window (the layers when not the default)."""
        value = f"{self.behind_s:g},{self.ahead_s:g},{self.stall_tokens}"
        return value if self.layers == MINIVOX_ALIGNING_LAYERS else f"{value},{layers_spec(self.layers)}"


def parse_layers(spec: str) -> tuple[int, ...]:
    """``"20-23"`` -> (20, 21, 22, 23); ranges and single layers joined by ``+`` (``"4+9-11"``)."""
    layers: list[int] = []
    for part in spec.split("+"):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo:
            raise ValueError(f"layers {part!r}: FIRST-LAST with 0 <= FIRST <= LAST")
        layers.extend(range(lo, hi + 1))
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {spec!r}: a layer given twice")
    return tuple(sorted(layers))


def layers_spec(layers: tuple[int, ...]) -> str:
    """The :func:`parse_layers` value of ``layers`` (sorted, distinct)."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return "+".join(f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


@dataclass
class ReadPosition:
    """The read position over ``n_audio`` audio tokens and how it moved (one clip).

    ``position`` only moves forward; ``floor`` is the first audio token a forced step left in
    the window (everything before it is out for good).
    """

    n_audio: int
    stall_tokens: int
    position: int = 0
    floor: int = 0
    still: int = 0  #: tokens since the position last moved
    forced: int = 0  #: forced steps so far
    path: list[int] = field(default_factory=list)  #: the position after each decoded token

    def advance(self, peak: int) -> None:
        """Move to ``peak`` (the aligning layers' attention peak) if it is ahead; count a
        stalled token otherwise, and after ``stall_tokens`` of them step one token forward."""
        if peak > self.position:
            self.position, self.still = peak, 0
        else:
            self.still += 1
            if self.still >= self.stall_tokens:
                self.position += 1
                self.floor, self.still = self.position, 0
                self.forced += 1
        self.path.append(self.position)

    @property
    def past_end(self) -> bool:
        """A forced step has left the audio: nothing is left to read."""
        return self.position >= self.n_audio


class ReadWindow:
    """The read window of one decoding (batch of one): which audio the aligning layers read.

    Parameters
    ----------
    config
        The window's shape.
    audio_start, n_audio
        Sequence position of the first audio token and the number of audio tokens (contiguous).
    audio_tokens_per_s
        The model's audio tokens per second of speech (minivox: 12.5).
    """

    def __init__(self, config: ReadWindowConfig, audio_start: int, n_audio: int,
                 audio_tokens_per_s: float) -> None:
        self.config = config
        self.audio_start = audio_start
        self.reading = ReadPosition(n_audio, config.stall_tokens)
        self._behind = round(config.behind_s * audio_tokens_per_s)
        self._ahead = round(config.ahead_s * audio_tokens_per_s)
        self._others = tuple(None if math.isinf(s) else round(s * audio_tokens_per_s)
                             for s in config.others_s)
        self._last_layer = max(config.layers)
        self._attention: torch.Tensor | None = None  # summed over the layers of this token
        self.windows: list[tuple[int, int]] = []  #: the window of each decode step
        #: the latest keep-mask of the aligning ("window") and the other ("others") layers
        self._masks: dict[str, tuple[tuple, torch.Tensor]] = {}

    @classmethod
    def for_inputs(cls, config: ReadWindowConfig, input_ids: torch.Tensor, audio_token_id: int,
                   audio_tokens_per_s: float) -> ReadWindow:
        """The window of a prompt ``input_ids`` (1, L) whose audio tokens are contiguous."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"read window: one sequence at a time, got a batch of {input_ids.shape[0]}")
        pos = torch.nonzero(input_ids[0] == audio_token_id).flatten()
        if pos.numel() == 0 or int(pos[-1] - pos[0]) + 1 != pos.numel():
            raise ValueError("read window: the prompt's audio tokens are missing or not contiguous")
        return cls(config, int(pos[0]), int(pos.numel()), audio_tokens_per_s)

    def window(self) -> tuple[int, int]:
        """``[lo, hi)``: the audio tokens (indices into the audio) the aligning layers read."""
        r = self.reading
        lo = max(0, r.position - self._behind, r.floor)
        return min(lo, r.n_audio), min(r.n_audio, r.position + self._ahead + 1)

    def restrict(self, read):
        """``read`` (..., T_a) bool, NumPy or torch: what a layer reads of the audio, narrowed
        to the window (a new array; ``read`` is left as it was)."""
        lo, hi = self.window()
        out = read.copy() if hasattr(read, "copy") else read.clone()
        out[..., :lo] = False
        out[..., hi:] = False
        return out

    def others_window(self) -> tuple[int, int]:
        """``[lo, hi)``: the audio the other decoder layers read (all of it unless
        ``config.others_s`` limits them; no forced floor: they are not reading in order)."""
        r, (behind, ahead) = self.reading, self._others
        lo = 0 if behind is None else max(0, r.position - behind)
        hi = r.n_audio if ahead is None else min(r.n_audio, r.position + ahead + 1)
        return lo, hi

    def keep(self, n_kv_heads: int, n_keys: int, span: tuple[int, int] | None = None) -> torch.Tensor | None:
        """(H_kv, n_keys) keep-mask of a decode step that reads the audio ``span`` (default:
        the aligning layers' :meth:`window`); None: it holds all audio, nothing masked. Built
        once per decode step: the layers of one step share it (read only)."""
        role = "window" if span is None else "others"
        lo, hi = self.window() if span is None else span
        if (lo, hi) == (0, self.reading.n_audio):
            return None
        shape = (lo, hi, n_kv_heads, n_keys)
        cached = self._masks.get(role)
        if cached is None or cached[0] != shape:
            keep = torch.ones(n_kv_heads, n_keys, dtype=torch.bool)
            keep[:, self.audio_start:self.audio_start + lo] = False
            keep[:, self.audio_start + hi:self.audio_start + self.reading.n_audio] = False
            cached = self._masks[role] = (shape, keep)
        return cached[1]

    def observe(self, layer: int, audio_attention: torch.Tensor) -> None:
        """Aligning layer ``layer``'s decode-step attention over the audio (H_q, T_a); after
        the last aligning layer the read position moves to the peak of the head-mean summed
        over the layers (:meth:`ReadPosition.advance`)."""
        probs = audio_attention.mean(0)
        self._attention = probs if self._attention is None else self._attention + probs
        if layer == self._last_layer:
            self.windows.append(self.window())
            self.reading.advance(int(self._attention.argmax()))
            self._attention = None

    def attention(self, module, layer: int, query, key, value, attention_mask, **kwargs):
        """Decoder layer ``layer``'s attention call: stock sdpa except at the aligning layers'
        decode steps (and, with ``config.others_s``, the other layers' decode steps)."""
        aligning = layer in self.config.layers
        if query.shape[2] != 1 or not (aligning or self.config.limits_others):
            return stock_attention(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling") or module.scaling
        if not aligning:
            keep = self.keep(key.shape[1], key.shape[2], self.others_window())
            if keep is None:
                return stock_attention(module, query, key, value, attention_mask, **kwargs)
            return masked_decode_attention(query, key, value, keep, scaling), None
        keep = self.keep(key.shape[1], key.shape[2])
        audio = slice(self.audio_start, self.audio_start + self.reading.n_audio)
        self.observe(layer, masked_attention_probs(query, key, keep, scaling)[:, audio])
        if keep is None:  # the stock path: bit-identical to plain decoding
            return stock_attention(module, query, key, value, attention_mask, **kwargs)
        return masked_decode_attention(query, key, value, keep, scaling), None


class ReadPastEnd(StoppingCriteria):
    """Stops generation once the window's forced steps have left the audio."""

    def __init__(self, window: ReadWindow) -> None:
        self.window = window

    @classmethod
    def criteria(cls, window: ReadWindow) -> StoppingCriteriaList:
        """The ``stopping_criteria`` argument of ``generate`` for ``window``."""
        return StoppingCriteriaList([cls(window)])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.window.reading.past_end, dtype=torch.bool)


def register_read_window() -> str:
    """Register the read-window attention function (and sdpa's mask under its name);
    idempotent. Returns the name to pass as ``attn_implementation={"text_config": name}``."""
    return register_dispatching_attention(READ_WINDOW_ATTN, ACTIVE)


@contextmanager
def reading_with(window: ReadWindow) -> Iterator[ReadWindow]:
    """Decode inside the block with ``window`` driving the registered attention function."""
    token = ACTIVE.set(window)
    try:
        yield window
    finally:
        ACTIVE.reset(token)
