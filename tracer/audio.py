"""Audio input for the tracer: decode (soundfile; wav/flac/ogg/mp3), mono mixdown, resample to
the model's rate, and reject bad inputs with a one-line reason."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

#: Peak amplitude below which an input counts as silent (-80 dBFS).
SILENCE_PEAK = 1e-4


class AudioError(Exception):
    """An input that cannot be traced; ``str()`` is the one-line reason."""


@dataclass(frozen=True)
class AudioClip:
    """Mono float32 samples at ``sample_rate`` Hz."""

    path: Path
    samples: np.ndarray
    sample_rate: int
    source_rate: int
    source_channels: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Polyphase resampling (``scipy.signal.resample_poly``) from ``src`` to ``dst`` Hz."""
    if src == dst:
        return x
    from scipy.signal import resample_poly

    ratio = Fraction(dst, src)
    return resample_poly(x, ratio.numerator, ratio.denominator).astype(np.float32)


def load_audio(path: str | Path, sample_rate: int) -> AudioClip:
    """Read ``path``, mix down to mono, resample to ``sample_rate``.

    Raises
    ------
    AudioError
        unreadable file, no samples, or a silent signal (peak below -80 dBFS).
    """
    import soundfile as sf

    path = Path(path)
    if not path.exists():
        raise AudioError("file not found")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile raises LibsndfileError, RuntimeError, TypeError...
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise AudioError(f"unreadable audio ({msg})") from None
    if data.shape[0] == 0:
        raise AudioError("empty audio (0 samples)")
    channels = data.shape[1]
    mono = data.mean(axis=1).astype(np.float32)
    if not np.isfinite(mono).all():
        raise AudioError("audio contains NaN or inf samples")
    peak = float(np.abs(mono).max())
    if peak < SILENCE_PEAK:
        raise AudioError(f"silent audio (peak {peak:.1e} < {SILENCE_PEAK:.0e})")
    return AudioClip(path, resample(mono, int(rate), sample_rate), sample_rate, int(rate), channels)
