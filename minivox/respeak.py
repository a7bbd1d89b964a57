"""Re-speak a split word for word with one speaking condition changed.

``test_new`` differs from the training data in three ways at once: its text (report prose),
its voices (espeak-ng variants no training voice uses) and its speaking rates (outside
:data:`~kvsim.minivox.data.TRAIN_RATES`). Its re-spoken twins read each ``test_new`` clip's
exact words again, changing the voice, the rate or both to the nearest training condition,
so that each factor's cost is a paired difference over the same words
(docs/minivox.md, "What test_new's errors come from").

The nearest training condition of a held-out voice is the training voice of the same espeak
accent (:data:`TRAINING_VOICE_OF`); of a held-out rate, a 16-word/min band at the nearest end
of the training rates (:func:`nearest_training_band`).
"""

from __future__ import annotations

import random
from pathlib import Path

from .clip_audio import ClipAssembly
from .heldout_text import split_sentences

# each held-out voice (data.HELDOUT_VOICES) -> the training voice (data.VOICES) of its accent:
# the base voice itself where training speaks it without a variant, else its only trained variant
TRAINING_VOICE_OF = {
    "en-us+m1": "en-us",
    "en-gb-x-rp+m4": "en-gb-x-rp",
    "en+m6": "en",
    "en-us-nyc+f5": "en-us-nyc",
    "en-029+m7": "en-029",
    "en-gb-scotland+m5": "en-gb-scotland+f1",
}
BAND_WIDTH = 16  # words/min in a nearest-training band: as wide as test_new's held-out bands


def nearest_training_band(rate: int, train_rates: tuple[int, int]) -> tuple[int, int]:
    """The training-rate band (inclusive, words/min) nearest ``rate``.

    A rate below the training range maps to its lowest :data:`BAND_WIDTH` rates, one above to
    its highest; a rate inside it maps to itself."""
    lo, hi = train_rates
    if rate < lo:
        return lo, lo + BAND_WIDTH - 1
    if rate > hi:
        return hi - BAND_WIDTH + 1, hi
    return rate, rate


def respeak_condition(voice: str, rate: int, *, training_voice: bool, training_rate: bool,
                      train_rates: tuple[int, int]) -> tuple[str, tuple[int, int]]:
    """The voice and rate band a re-spoken clip gets: the source's, or the nearest training
    one for each factor asked for."""
    if training_voice:
        if voice not in TRAINING_VOICE_OF:
            raise ValueError(f"voice {voice!r} has no training voice of its accent "
                             f"(known: {sorted(TRAINING_VOICE_OF)})")
        voice = TRAINING_VOICE_OF[voice]
    band = nearest_training_band(rate, train_rates) if training_rate else (rate, rate)
    return voice, band


def respeak_clip(tts, text: str, voice: str, rate_range: tuple[int, int],
                 rng: random.Random) -> dict:
    """Speak ``text`` again, sentence by sentence, the way ``data.make_clip`` builds a clip:
    a lead silence, pauses of 0.25-0.9 s between sentences, a tail silence and a drawn gain.

    Raises ``RuntimeError`` where espeak's word events disagree with a sentence's words: the
    clip would no longer read the source's words one for one."""
    rate = rng.randint(*rate_range)
    pitch = rng.randint(35, 65)
    clip = ClipAssembly()
    clip.silence(rng.uniform(0.1, 0.6))
    for k, sentence in enumerate(split_sentences(text)):
        if k:
            clip.silence(rng.uniform(0.25, 0.9))
        syn = tts.synth(sentence, voice=voice, rate=rate, pitch=pitch)
        if len(syn.words) != len(sentence.split()) or syn.audio.size == 0:
            raise RuntimeError(f"espeak's word events disagree with the sentence {sentence!r} "
                               f"(voice {voice}, rate {rate})")
        clip.speech(syn)
    return clip.finish(rng, text, voice, rate)


def source_rows(out: Path, split: str) -> list[dict]:
    """The manifest rows of the complete split ``split`` under ``out`` (its part file)."""
    import polars as pl

    part = out / "parts" / f"{split}.parquet"
    if not part.is_file():
        raise RuntimeError(f"{part}: the split to re-speak is not generated "
                           f"(generate {split} first)")
    return pl.read_parquet(part).sort("id").to_dicts()
