"""The decoding options' logits processors of one decoding, built in one place for ``kvsim
live`` and minivox's evaluation so that both apply them alike: the cycle ban
(:mod:`.cycle_ban`), then the held end (:mod:`.hold_end`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsim.decoding.cycle_ban import CycleBan, CycleBanConfig
from kvsim.decoding.hold_end import HoldEnd
from kvsim.decoding.read_window import ReadWindow


@dataclass
class OptionProcessors:
    """The cycle ban and the held end of one decoding (None: that option is off)."""

    ban: CycleBan | None = None
    hold: HoldEnd | None = None

    @classmethod
    def build(cls, ban_cycles: CycleBanConfig | None, prompt_length: int, hold_s: float | None,
              window: ReadWindow | None, n_speech: Callable[[], int], eos_ids: Sequence[int],
              audio_tokens_per_s: float) -> OptionProcessors:
        """The processors of the options that are on; ``prompt_length``: tokens before the
        answer in the ids the processors see; ``n_speech`` (called only with the hold): audio
        tokens that hold speech."""
        ban = CycleBan(ban_cycles, prompt_length) if ban_cycles is not None else None
        if hold_s is None:
            return cls(ban, None)
        if window is None:
            raise ValueError("--hold-end: needs --read-window (the read position it waits for)")
        return cls(ban, HoldEnd(window, n_speech(), hold_s, list(eos_ids), audio_tokens_per_s))

    def as_list(self) -> list[CycleBan | HoldEnd]:
        """The processors that are on, in the order they apply."""
        return [p for p in (self.ban, self.hold) if p is not None]
