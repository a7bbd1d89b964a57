"""Hold the end: with a read window, the answer may not end before its reader reached the end of the speech.

A decoding option of :mod:`kvsim.minivox.evaluate`, ``kvsim live`` and ``kvsim study table5``
(``--hold-end SECONDS``, with ``--read-window``), not the papers' protocol (plain greedy
decoding). Under the read window
(:mod:`kvsim.decoding.read_window`) minivox sometimes writes its end-of-answer token in the
middle of a clip, after a loop the cycle ban broke (test_long-00021 ends after 85 tokens of a
183 s clip: docs/minivox.md, "Hold the end"). A reader whose aligning layers are still
seconds before the end of the speech has not finished: while the read position is more than
``hold_s`` seconds before the last audio token that holds speech (the last window's padding
excluded), the end-of-answer tokens get a logit of minus infinity and greedy decoding writes
its next choice. The window's pushes keep the position moving, so a held end is reached.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import LogitsProcessor

from kvsim.decoding.read_window import ReadWindow, ReadWindowConfig


def check_hold_end(hold_s: float | None, read_window: ReadWindowConfig | None) -> None:
    """ValueError naming ``--hold-end`` unless the hold is off (None), or ``hold_s`` seconds
    >= 0 with a ``read_window`` (the read position it waits for)."""
    if hold_s is None:
        return
    if read_window is None:
        raise ValueError("--hold-end: needs --read-window (the read position it waits for)")
    if not 0 <= hold_s < math.inf:
        raise ValueError(f"--hold-end {hold_s}: seconds >= 0")


def speech_tokens(samples: int, sampling_rate: int, audio_tokens_per_s: float) -> int:
    """Audio tokens that hold any of ``samples`` of speech (the rest of the last window is padding)."""
    return math.ceil(samples * audio_tokens_per_s / sampling_rate)


def speech_tokens_of(padding: np.ndarray) -> int:
    """Audio tokens up to the last one that is not encoder padding (``padding``: one mark per
    audio token, True where the token was encoded from the zeros that fill the last window)."""
    speech = np.flatnonzero(~np.asarray(padding, dtype=bool))
    return int(speech[-1]) + 1 if speech.size else 0


class HoldEnd(LogitsProcessor):
    """Bans ``eos_ids`` while ``window``'s read position is more than ``hold_s`` seconds
    before the end of its ``n_speech`` audio tokens of speech.

    Parameters
    ----------
    window
        The read window of the decoding (its position moves as the aligning layers read).
    n_speech
        Audio tokens that hold speech (:func:`speech_tokens`); at most the window's audio.
    hold_s
        Seconds before the end of the speech from which the answer may end.
    eos_ids
        The model's end-of-answer token ids.
    audio_tokens_per_s
        The model's audio tokens per second.
    """

    def __init__(self, window: ReadWindow, n_speech: int, hold_s: float, eos_ids: list[int],
                 audio_tokens_per_s: float) -> None:
        if not 0 < n_speech <= window.reading.n_audio:
            raise ValueError(f"hold end: {n_speech} speech tokens of {window.reading.n_audio} audio tokens")
        if not 0 <= hold_s < math.inf:
            raise ValueError(f"hold end: {hold_s} s must be >= 0")
        self.window = window
        self.end = n_speech - round(hold_s * audio_tokens_per_s)  #: first position that may end
        self.eos_ids = list(eos_ids)
        self.held = 0  #: decoding steps whose greedy choice was an end-of-answer token, held back

    @property
    def holding(self) -> bool:
        """The read position is still too far from the end of the speech to end."""
        return self.window.reading.position < self.end

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.holding:
            return scores
        self.held += int(int(scores[0].argmax()) in self.eos_ids)
        scores = scores.clone()
        scores[:, self.eos_ids] = -math.inf
        return scores
