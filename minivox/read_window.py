"""Read window: greedy decoding that keeps minivox's aligning layers reading the audio in order.

An option of :mod:`kvsim.minivox.evaluate` (``--read-window``), not the paper's protocol
(plain greedy decoding over the full cache). Every key stays in the cache and every decoder
layer but the aligning ones reads all of it; the aligning layers (20-23, where minivox's
attention follows the words) read only the audio inside a window around the
current read position, the way inference-time attention windows keep text-to-speech decoders
from skipping and repeating (Tacotron-style windowed attention).

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

from .modeling import AUDIO_TOKENS_PER_SECOND
from .option_spec import parse_comma_option

#: The name the read-window attention function is registered under.
READ_WINDOW_ATTN = "minivox_read_window"

#: The window driving the attention calls of the current thread (None: plain sdpa).
ACTIVE: contextvars.ContextVar[ReadWindow | None] = contextvars.ContextVar(
    "minivox_read_window", default=None)


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
        The aligning decoder layers: minivox's 20-23, whose attention peak follows the word
        being written (the guided loss's default layers, docs/minivox.md "Training").
    """

    behind_s: float = 2.0
    ahead_s: float = 3.0
    stall_tokens: int = 8
    layers: tuple[int, ...] = (20, 21, 22, 23)

    def __post_init__(self) -> None:
        if not (0 <= self.behind_s < math.inf and 0 < self.ahead_s < math.inf):
            raise ValueError(f"read window: behind {self.behind_s} s must be >= 0 and ahead "
                             f"{self.ahead_s} s > 0")
        if self.stall_tokens < 1:
            raise ValueError(f"read window: stall {self.stall_tokens} tokens must be >= 1")
        if not self.layers:
            raise ValueError("read window: no aligning layers")

    @classmethod
    def parse(cls, spec: str) -> ReadWindowConfig:
        """``"BEHIND,AHEAD,STALL"`` (seconds, seconds, tokens), e.g. ``"2,3,8"``."""
        return parse_comma_option(cls, spec, "--read-window", "BEHIND,AHEAD,STALL (e.g. 2,3,8)",
                                  (float, float, int))

    def spec(self) -> str:
        """The ``--read-window`` value that gives this window."""
        return f"{self.behind_s:g},{self.ahead_s:g},{self.stall_tokens}"


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
    """

    def __init__(self, config: ReadWindowConfig, audio_start: int, n_audio: int) -> None:
        self.config = config
        self.audio_start = audio_start
        self.reading = ReadPosition(n_audio, config.stall_tokens)
        self._behind = round(config.behind_s * AUDIO_TOKENS_PER_SECOND)
        self._ahead = round(config.ahead_s * AUDIO_TOKENS_PER_SECOND)
        self._last_layer = max(config.layers)
        self._attention: torch.Tensor | None = None  # summed over the layers of this token

    @classmethod
    def for_inputs(cls, config: ReadWindowConfig, input_ids: torch.Tensor,
                   audio_token_id: int) -> ReadWindow:
        """The window of a prompt ``input_ids`` (1, L) whose audio tokens are contiguous."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"read window: one sequence at a time, got a batch of {input_ids.shape[0]}")
        pos = torch.nonzero(input_ids[0] == audio_token_id).flatten()
        if pos.numel() == 0 or int(pos[-1] - pos[0]) + 1 != pos.numel():
            raise ValueError("read window: the prompt's audio tokens are missing or not contiguous")
        return cls(config, int(pos[0]), int(pos.numel()))

    def window(self) -> tuple[int, int]:
        """``[lo, hi)``: the audio tokens (indices into the audio) the aligning layers read."""
        r = self.reading
        lo = max(0, r.position - self._behind, r.floor)
        return min(lo, r.n_audio), min(r.n_audio, r.position + self._ahead + 1)

    def keep(self, n_kv_heads: int, n_keys: int) -> torch.Tensor | None:
        """(H_kv, n_keys) keep-mask of an aligning layer's decode step; None: nothing masked."""
        lo, hi = self.window()
        if lo == 0 and hi == self.reading.n_audio:
            return None
        keep = torch.ones(n_kv_heads, n_keys, dtype=torch.bool)
        keep[:, self.audio_start: self.audio_start + lo] = False
        keep[:, self.audio_start + hi: self.audio_start + self.reading.n_audio] = False
        return keep

    def attention(self, module, layer: int, query, key, value, attention_mask, **kwargs):
        """Decoder layer ``layer``'s attention call: stock sdpa except at the aligning layers'
        decode steps."""
        if query.shape[2] != 1 or layer not in self.config.layers:
            return stock_attention(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling") or module.scaling
        keep = self.keep(key.shape[1], key.shape[2])
        audio = slice(self.audio_start, self.audio_start + self.reading.n_audio)
        probs = masked_attention_probs(query, key, keep, scaling)[:, audio].mean(0)
        self._attention = probs if self._attention is None else self._attention + probs
        if layer == self._last_layer:
            self.reading.advance(int(self._attention.argmax()))
            self._attention = None
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
