"""One clip's audio put together the way every minivox split builds it: a lead silence,
pieces of speech with pauses between them, a tail silence and a drawn gain, with each word's
times on the clip's clock (:func:`kvsim.minivox.data.make_clip`,
:func:`kvsim.minivox.respeak.respeak_clip`)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 16000


@dataclass
class ClipAssembly:
    """The clip so far: its pieces and its words' times; ``t`` is where the next piece starts
    (seconds, the sum of the durations asked for, as the word times count them)."""

    t: float = 0.0
    pieces: list[np.ndarray] = field(default_factory=list)
    words: list[str] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def silence(self, seconds: float) -> None:
        self.pieces.append(np.zeros(int(seconds * SAMPLE_RATE), np.float32))
        self.t += seconds

    def speech(self, syn) -> None:
        """Append one synthesis (``audio``, ``words``, ``starts``, ``ends`` of
        :class:`~kvsim.minivox.espeak.ESpeak`)."""
        self.pieces.append(syn.audio)
        self.words += syn.words
        self.starts += [self.t + s for s in syn.starts]
        self.ends += [self.t + e for e in syn.ends]
        self.t += syn.audio.size / SAMPLE_RATE

    def finish(self, rng: random.Random, text: str, voice: str, rate: int) -> dict:
        """The clip's record: a tail silence of 0.1-0.5 s and a peak gain of 0.3-0.9 drawn
        from ``rng``, in that order."""
        self.pieces.append(np.zeros(int(rng.uniform(0.1, 0.5) * SAMPLE_RATE), np.float32))
        audio = np.concatenate(self.pieces)
        peak = float(np.abs(audio).max()) or 1.0
        audio = audio * (rng.uniform(0.3, 0.9) / peak)
        return {"audio": audio.astype(np.float32), "text": text, "words": self.words,
                "word_start": [round(x, 4) for x in self.starts],
                "word_end": [round(x, 4) for x in self.ends], "voice": voice, "rate": rate}
