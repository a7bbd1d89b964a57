"""Cycle ban: greedy decoding that may not write a short cycle of tokens more than R times in a row.

A decoding option of ``kvsim live`` and of :mod:`kvsim.minivox.evaluate` (``--ban-cycles``),
not the papers' protocol (plain greedy decoding). The loops minivox is left with under the read
window (:mod:`kvsim.decoding.read_window`) are short cycles written over and over ("China, China,
China, ..."; "or assert, or assert, ..."): docs/minivox.md, "Break the loops". Hugging Face's ``no_repeat_ngram_size`` bans every n-gram written before anywhere in
the transcript, which also forbids the phrases a text legitimately repeats; this ban looks only
at the tail: once the last ``repeats * p`` generated tokens are ``repeats`` copies of one cycle
of ``p`` tokens (any ``p`` up to ``max_period``), the token that would start one more copy
gets a logit of minus infinity, and greedy decoding writes its next choice instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

from kvsim.decoding.option_spec import parse_comma_option


@dataclass(frozen=True)
class CycleBanConfig:
    """Which repetitions are banned.

    Parameters
    ----------
    max_period
        The longest cycle looked for, in tokens.
    repeats
        Copies of a cycle allowed in a row; the token that would start one more is banned.
    """

    max_period: int = 16
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.max_period < 1:
            raise ValueError(f"cycle ban: period {self.max_period} must be >= 1")
        if self.repeats < 2:
            raise ValueError(f"cycle ban: repeats {self.repeats} must be >= 2")

    @classmethod
    def parse(cls, spec: str) -> CycleBanConfig:
        """``"MAX_PERIOD,REPEATS"`` (tokens, copies), e.g. ``"16,3"``."""
        return parse_comma_option(cls, spec, "--ban-cycles", "MAX_PERIOD,REPEATS (e.g. 16,3)",
                                  (int, int))

    def spec(self) -> str:
        """The ``--ban-cycles`` value that gives this ban."""
        return f"{self.max_period},{self.repeats}"


def cycle_starts(tokens: torch.Tensor, config: CycleBanConfig) -> set[int]:
    """The tokens that would start one copy too many of a cycle ending ``tokens`` (1-D)."""
    banned = set()
    for period in range(1, config.max_period + 1):
        span = period * config.repeats
        if span > tokens.numel():  # and so for every longer period
            break
        copies = tokens[-span:].view(config.repeats, period)
        if bool((copies == copies[0]).all()):
            banned.add(int(copies[0, 0]))
    return banned


class CycleBan(LogitsProcessor):
    """The ban as a ``generate`` logits processor over the tokens generated after the prompt.

    Parameters
    ----------
    config
        Which repetitions are banned.
    prompt_length
        Tokens of the prompt (the audio and the instruction), which the ban does not read.
    """

    def __init__(self, config: CycleBanConfig, prompt_length: int) -> None:
        self.config = config
        self.prompt_length = prompt_length
        self.fired = 0  #: decoding steps at which something was banned

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        fired = False
        for row in range(input_ids.shape[0]):
            banned = cycle_starts(input_ids[row, self.prompt_length:], self.config)
            if banned:
                scores[row, sorted(banned)] = -torch.inf
                fired = True
        self.fired += fired
        return scores
