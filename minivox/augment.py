"""Speed perturbation of training clips (audio and word times together).

Speed perturbation as in Kaldi and ESPnet (Ko et al., "Audio augmentation for speech
recognition", Interspeech 2015): the waveform is resampled so that it plays ``factor`` times
faster, which changes tempo and pitch together; the usual factors are 0.9, 1.0 and 1.1. The
word times of the manifest row scale by ``1 / factor`` so that the alignment-guided loss
(:mod:`kvsim.minivox.guided`) still points at the words. A perturbed row carries its factor
under ``"speed"``; :func:`kvsim.minivox.train.encoder_cache` resamples and caches it under its
own name.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

import numpy as np
from scipy.signal import resample_poly

# the largest denominator of a factor's rational form: 1.1 = 11/10, 0.95 = 19/20
_MAX_DENOMINATOR = 100


def parse_factors(spec: str) -> tuple[float, ...]:
    """``"0.9,1.0,1.1"`` -> ``(0.9, 1.0, 1.1)``; ``""`` -> ``()`` (no perturbation)."""
    if not spec.strip():
        return ()
    try:
        factors = tuple(float(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"speed factors: expected numbers separated by commas, got {spec!r}") from None
    bad = [f for f in factors if not 0.5 <= f <= 2.0]
    if bad:
        raise ValueError(f"speed factors must lie in [0.5, 2]: got {bad}")
    return factors


def speed_ratio(factor: float) -> tuple[int, int]:
    """``(up, down)`` with ``up / down`` = 1 / ``factor`` (the sample-count ratio)."""
    frac = Fraction(factor).limit_denominator(_MAX_DENOMINATOR)
    return frac.denominator, frac.numerator


def resample_speed(audio: np.ndarray, factor: float) -> np.ndarray:
    """``audio`` played ``factor`` times faster: ``len / factor`` samples (polyphase
    resampling with an anti-aliasing filter; pitch and tempo scale together)."""
    up, down = speed_ratio(factor)
    if up == down:
        return audio
    return resample_poly(audio, up, down).astype(audio.dtype, copy=False)


def speed_row(row: dict, factor: float) -> dict:
    """A copy of a manifest row (or of a joined row, part by part: the encoder reads the parts)
    as heard at ``factor``: word times and duration divided by it, ``"speed"`` set."""
    if "parts" in row:
        return {**row, "parts": [speed_row(p, factor) for p in row["parts"]]}
    scale = 1.0 / factor
    return {**row, "speed": factor, "duration": row["duration"] * scale,
            "word_start": [t * scale for t in row["word_start"]],
            "word_end": [t * scale for t in row["word_end"]]}


def perturb_rows(rows: Sequence[dict], factors: Sequence[float], seed: int, step: int) -> list[dict]:
    """The rows of training step ``step``, each at a factor drawn from ``factors`` (uniformly,
    a deterministic function of ``(seed, step)``); unchanged without factors."""
    if not factors:
        return list(rows)
    rng = np.random.default_rng([seed, step, 13])
    picks = rng.integers(len(factors), size=len(rows))
    return [r if factors[k] == 1.0 else speed_row(r, factors[k])
            for r, k in zip(rows, picks, strict=True)]
