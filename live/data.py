"""Inputs of live decoding: audio + reference text from a few dataset layouts.

Layouts (``kvsim live --dataset KIND ROOT``):

* ``dir`` -- a folder of ``*.wav`` / ``*.flac`` with same-stem ``*.txt`` references.
* ``librispeech-long`` -- LibriSpeech-Long (Park et al. 2024; google-deepmind/librispeech-long).
  Its archive ``v0_1.tar.gz`` extracts to ``librispeech-long/<split>/<speaker>/<chapter>/
  <chapter>_<segment:04d>.flac`` with a same-stem ``.txt`` holding the reference on one line
  (the layout as read by a public corpus job of the archive, rwth-i6 i6_experiments, not by a
  local copy); splits are ``dev-clean``, ``dev-other``, ``test-clean``, ``test-other``, chosen
  with ``--split``. Such files get the id ``<speaker>-<chapter>-<segment>``. Plain LibriSpeech
  trees (``<spk>-<chap>-<utt>.flac`` with the chapter's ``<spk>-<chap>.trans.txt``, lines
  ``<utterance-id> <TEXT>``) are read too; the search is recursive.
* ``primock57`` -- the published PriMock57 repository layout (verified on GitHub):
  ``audio/dayD_consultationNN_{doctor,patient}.wav`` and
  ``transcripts/<same stem>.TextGrid`` (one IntervalTier of utterances; ``<UNSURE>x</UNSURE>``
  keeps ``x``, ``<UNIN/>`` and other tags are dropped). Each speaker channel is one input.
* ``longspeech`` -- LongSpeech (Yang et al. 2026; Hugging Face ``ATH-MaaS/Marco_Longspeech``):
  per-task metadata ``LongSpeechQA/<TASK>/test.jsonl``, one JSON object per line with
  ``task``, ``language`` and ``messages`` = [user {``audio``: path relative to the dataset
  root, e.g. ``LongSpeech_p1/wavs/part_00/000001.wav``, ``content``: the prompt}, assistant
  {``content``: the reference}]. ``--split TASK[:LANGUAGE]`` picks the task file and filters
  rows on their ``language`` field (``asr-fr`` is read as ``ASR:fr``); ``translation`` rows
  are decoded with ``--task translate`` and scored with sacreBLEU. This layout is taken from
  a public evaluation harness of the dataset (and agrees with two other public users of it),
  not from a local copy: the loader names
  the file, line and field of anything that does not match, and lists the languages present
  when a filter matches nothing.
* ``manifest`` -- the project's espeak long-form sets: a ``manifest.parquet`` with columns
  ``audio_path`` (relative to the manifest's folder), ``text``, ``duration``, optionally
  ``id``, ``split``, ``words``, ``word_start``, ``word_end`` (minivox/data.py);
  ``--split`` selects rows.

``--max-seconds`` crops long inputs; when word or utterance times are known the reference is
cropped to what was spoken before the cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AUDIO_EXT = (".wav", ".flac")
SAMPLE_RATE = 16000


class DataError(ValueError):
    """A dataset file is missing or malformed (the message names it)."""


@dataclass
class LiveInput:
    """One clip to decode."""

    id: str
    audio_path: Path
    reference: str | None
    task: str = "transcribe"  #: transcribe | translate
    #: (start_s, end_s, text) segments of the reference when known (for cropping)
    segments: list[tuple[float, float, str]] | None = None

    def load(self, max_seconds: float | None = None) -> tuple[np.ndarray, str | None]:
        """16 kHz mono float32 audio (cropped) and the matching reference."""
        audio = load_audio(self.audio_path)
        ref = self.reference
        if max_seconds is not None and len(audio) > max_seconds * SAMPLE_RATE:
            audio = audio[: int(max_seconds * SAMPLE_RATE)]
            if self.segments is not None:
                ref = " ".join(t for s, e, t in self.segments if e <= max_seconds + 1e-6)
        return audio, ref


def load_audio(path: Path) -> np.ndarray:
    """Read an audio file as 16 kHz mono float32, rejecting what ``kvsim trace`` rejects
    (unreadable, empty, NaN/inf samples, silence): :func:`kvsim.tracer.audio.load_audio`.

    Raises
    ------
    DataError
        ``<path>: <reason>``, one line.
    """
    from kvsim.tracer.audio import AudioError
    from kvsim.tracer.audio import load_audio as read_checked

    try:
        clip = read_checked(path, SAMPLE_RATE)
    except AudioError as exc:
        raise DataError(f"{path}: {exc}") from None
    return np.ascontiguousarray(clip.samples, dtype=np.float32)


# ----------------------------------------------------------------------------- layouts
def from_dir(root: Path) -> list[LiveInput]:
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in AUDIO_EXT)
    if not files:
        raise DataError(f"{root}: no *.wav or *.flac files")
    out = []
    for p in files:
        txt = p.with_suffix(".txt")
        ref = txt.read_text().strip() if txt.exists() else None
        out.append(LiveInput(p.stem, p, ref))
    return out


_LS_LONG_STEM = re.compile(r"^(\d+)_(\d+)$")


def librispeech_id(path: Path) -> str:
    """``<speaker>-<chapter>-<segment>`` for a LibriSpeech-Long file
    ``<speaker>/<chapter>/<chapter>_<segment>.flac``; the file stem otherwise."""
    m = _LS_LONG_STEM.match(path.stem)
    if m and m.group(1) == path.parent.name and path.parent.parent.name.isdigit():
        return f"{path.parent.parent.name}-{m.group(1)}-{m.group(2)}"
    return path.stem


def from_librispeech(root: Path, split: str | None = None) -> list[LiveInput]:
    if split:
        present = sorted(p.name for p in root.iterdir() if p.is_dir())
        if split not in present:
            raise DataError(f"{root}: no split {split!r} (LibriSpeech-Long layout "
                            f"<split>/<speaker>/<chapter>/); present: {', '.join(present) or 'none'}")
        root = root / split
    files = sorted((p for p in root.rglob("*") if p.suffix.lower() in AUDIO_EXT),
                   key=lambda p: p.relative_to(root).parts)
    if not files:
        raise DataError(f"{root}: no audio files found (LibriSpeech-Long layout)")
    trans: dict[str, str] = {}
    for t in root.rglob("*.trans.txt"):
        for n, line in enumerate(t.read_text().splitlines(), 1):
            if not line.strip():
                continue
            uid, _, text = line.partition(" ")
            if not text:
                raise DataError(f"{t}:{n}: expected '<utterance-id> <text>'")
            trans[uid] = text.strip()
    out = []
    for p in files:
        txt = p.with_suffix(".txt")
        has_txt = txt.exists()
        ref = txt.read_text(encoding="utf-8").strip() if has_txt else trans.get(p.stem)
        if ref is None:
            raise DataError(f"{p}: no reference ({txt.name} or a .trans.txt line {p.stem})")
        if not ref:
            raise DataError(f"{txt if has_txt else p}: empty reference")
        out.append(LiveInput(librispeech_id(p), p, ref))
    return out


_TAG_KEEP = re.compile(r"</?UNSURE>")
_TAG_DROP = re.compile(r"<[^>]*/?>")


def clean_primock_text(text: str) -> str:
    """PriMock57 transcript markup: keep ``<UNSURE>`` contents, drop ``<UNIN/>`` and tags."""
    text = _TAG_KEEP.sub("", text)
    return " ".join(_TAG_DROP.sub(" ", text).split())


def read_textgrid(path: Path) -> list[tuple[float, float, str]]:
    """Intervals (xmin, xmax, text) of the first IntervalTier of a Praat TextGrid (long text
    format), non-empty texts only."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"{path}: {exc}") from None
    if "IntervalTier" not in raw:
        raise DataError(f"{path}: not a TextGrid with an IntervalTier")
    pat = re.compile(r'xmin = ([\d.eE+-]+)\s*\n\s*xmax = ([\d.eE+-]+)\s*\n\s*text = "((?:[^"]|"")*)"')
    out = []
    for m in pat.finditer(raw):
        text = clean_primock_text(m.group(3).replace('""', '"'))
        if text:
            out.append((float(m.group(1)), float(m.group(2)), text))
    return out


def from_primock57(root: Path) -> list[LiveInput]:
    audio_dir, tr_dir = root / "audio", root / "transcripts"
    if not audio_dir.is_dir() or not tr_dir.is_dir():
        raise DataError(f"{root}: expected audio/ and transcripts/ (PriMock57 layout)")
    out = []
    for p in sorted(audio_dir.glob("day*_consultation*_*.wav")):
        tg = tr_dir / f"{p.stem}.TextGrid"
        if not tg.exists():
            raise DataError(f"{p}: missing transcript {tg}")
        segs = read_textgrid(tg)
        out.append(LiveInput(p.stem, p, " ".join(t for _, _, t in segs), segments=segs))
    if not out:
        raise DataError(f"{audio_dir}: no dayD_consultationNN_<speaker>.wav files")
    return out


def from_manifest(path: Path, split: str | None = None) -> list[LiveInput]:
    import polars as pl

    if path.is_dir():
        path = path / "manifest.parquet"
    if not path.exists():
        raise DataError(f"{path}: manifest not found")
    df = pl.read_parquet(path, glob=False)
    for col in ("audio_path", "text"):
        if col not in df.columns:
            raise DataError(f"{path}: manifest has no column {col!r}")
    if split is not None:
        if "split" not in df.columns:
            raise DataError(f"{path}: --split given but the manifest has no 'split' column")
        df = df.filter(pl.col("split") == split)
        if df.height == 0:
            raise DataError(f"{path}: no rows with split == {split!r}")
    out = []
    for i, row in enumerate(df.iter_rows(named=True)):
        segs = None
        if row.get("words") is not None and row.get("word_end") is not None:
            segs = [(float(s), float(e), w) for w, s, e in
                    zip(row["words"], row["word_start"], row["word_end"], strict=True)]
        out.append(LiveInput(str(row.get("id") or i), path.parent / row["audio_path"], row["text"],
                             segments=segs))
    return out


LONGSPEECH_TASKS = {"ASR": "transcribe", "translation": "translate"}


def parse_longspeech_split(split: str | None) -> tuple[str, str | None]:
    """``TASK[:LANGUAGE]`` (or ``asr-LANG``) -> (task file name, language filter)."""
    if not split:
        raise DataError("--dataset longspeech needs --split TASK[:LANGUAGE], e.g. ASR:fr or "
                        "translation:en2fr (tasks: " + ", ".join(LONGSPEECH_TASKS) + ")")
    if split.lower().startswith("asr-"):
        return "ASR", split[4:]
    task, _, lang = split.partition(":")
    task = {t.lower(): t for t in LONGSPEECH_TASKS}.get(task.lower(), task)
    if task not in LONGSPEECH_TASKS:
        raise DataError(f"--split {split!r}: LongSpeech task must be one of "
                        f"{', '.join(LONGSPEECH_TASKS)} (speech-to-text tasks with a reference text)")
    return task, lang or None


def from_longspeech(root: Path, split: str | None) -> list[LiveInput]:
    import json

    task, lang = parse_longspeech_split(split)
    meta = root / "LongSpeechQA" / task / "test.jsonl"
    if not meta.is_file():
        raise DataError(f"{meta}: not found (LongSpeech layout: LongSpeechQA/<TASK>/test.jsonl)")
    out, seen = [], set()
    for n, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{meta}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not JSON ({exc.msg})") from None
        msgs = row.get("messages") if isinstance(row, dict) else None
        if isinstance(msgs, str):  # some exports store the list as a JSON string
            try:
                msgs = json.loads(msgs)
            except json.JSONDecodeError:
                msgs = None
        if not (isinstance(msgs, list) and len(msgs) >= 2 and all(isinstance(m, dict) for m in msgs[:2])):
            raise DataError(f"{where}: field 'messages' must be a list [user, assistant]")
        user, assistant = msgs[0], msgs[1]
        audio, ref = user.get("audio"), assistant.get("content")
        if not isinstance(audio, str) or not audio:
            raise DataError(f"{where}: field 'messages[0].audio' (the audio path) is missing")
        if not isinstance(ref, str):
            raise DataError(f"{where}: field 'messages[1].content' (the reference) is missing")
        row_lang = str(row.get("language", ""))
        seen.add(row_lang)
        if lang is not None and row_lang.lower() != lang.lower():
            continue
        out.append(LiveInput(f"{task}-{n - 1:06d}", root / audio, ref, task=LONGSPEECH_TASKS[task]))
    if not out:
        raise DataError(f"{meta}: no rows with language {lang!r}; languages present: "
                        f"{', '.join(sorted(seen)) or 'none'}")
    return out


DATASETS = {"dir": from_dir, "librispeech-long": from_librispeech, "primock57": from_primock57,
            "longspeech": from_longspeech, "manifest": from_manifest}
# the loaders that take a split (the others read every input under the root)
SPLIT_DATASETS = ("manifest", "longspeech", "librispeech-long")


def load_dataset(kind: str, root: Path, split: str | None = None, limit: int | None = None) -> list[LiveInput]:
    """Inputs of dataset ``kind`` under ``root`` (see module docstring)."""
    if kind not in DATASETS:
        raise DataError(f"--dataset {kind!r}: choose one of {', '.join(DATASETS)}")
    if not root.exists():
        raise DataError(f"{root}: does not exist")
    if kind in SPLIT_DATASETS:
        items = DATASETS[kind](root, split)
    elif split is not None:
        raise DataError(f"--dataset {kind} has no splits (--split {split!r}); --split applies to "
                        f"{', '.join(SPLIT_DATASETS)}")
    else:
        items = DATASETS[kind](root)
    return items[:limit] if limit else items


def select_ids(items: list[LiveInput], ids: list[str]) -> list[LiveInput]:
    """The inputs named in ``ids``, in that order; an unknown id is an error that lists some
    of the known ones."""
    by_id = {it.id: it for it in items}
    missing = [i for i in ids if i not in by_id]
    if missing:
        known = ", ".join(list(by_id)[:5]) + (", ..." if len(by_id) > 5 else "")
        raise DataError(f"--ids: no input {', '.join(missing)} among the {len(by_id)} inputs "
                        f"({known})")
    return [by_id[i] for i in ids]


def looks_like_path(value: str) -> bool:
    """The ``--reference`` rule: a value is a file name when it ends in ``.txt`` (any case)
    or is one word holding a ``/``; anything else is the reference text itself."""
    return value.lower().endswith(".txt") or ("/" in value and len(value.split()) == 1)


def reference_text(value: str) -> str:
    """The reference a ``--reference`` value gives (:func:`looks_like_path`: the content of
    that file, else the value itself).

    Raises
    ------
    DataError
        ``--reference VALUE: no such file or directory`` (the wording of ``kvsim trace``), or
        the file is not a readable regular UTF-8 file, or it holds no text.
    """
    if not looks_like_path(value):
        return value
    if not Path(value).exists():
        raise DataError(f"--reference {value}: no such file or directory")
    return read_reference(Path(value), f"--reference {value}")


def read_reference(path: Path, label: str | None = None) -> str:
    """The stripped text of the reference file ``path`` (a regular file, read bounded and
    without blocking by :func:`kvsim.trace.members.read_member`); DataError
    ``LABEL: reason`` (``LABEL`` defaults to the path) when unreadable or empty."""
    from kvsim.trace.members import read_text_member
    from kvsim.trace.schema import TraceError

    label = label or str(path)
    try:
        text = read_text_member(path).strip()
    except TraceError as exc:
        raise DataError(f"{label}: {exc.message}") from None
    if not text:
        raise DataError(f"{label}: empty reference")
    return text


def _check_reference_count(paths: list[Path], references: list[str]) -> None:
    """One ``--reference`` per audio file argument, in order; none with a folder (its
    references are its same-stem .txt files)."""
    if len(references) != len(paths):
        raise DataError(f"--reference: {len(references)} value{'s' * (len(references) != 1)} "
                        f"for {len(paths)} input{'s' * (len(paths) != 1)} (one per audio file, "
                        "in order)")
    folder = next((p for p in paths if p.is_dir()), None)
    if folder is not None:
        raise DataError(f"--reference: {folder} is a folder; its references are its same-stem "
                        ".txt files (give --reference only with audio files)")


def from_paths(paths: list[Path], references: list[str] | None = None) -> list[LiveInput]:
    """Plain audio files on the command line; references from ``--reference`` (one per file,
    in order: a text, or a file by :func:`looks_like_path`) or same-stem .txt files.

    Raises
    ------
    DataError
        A missing input, a bad ``--reference`` value (:func:`reference_text`) or a count of
        them that is not one per audio file.
    """
    if references:
        _check_reference_count(paths, references)
    out = []
    for i, p in enumerate(paths):
        if p.is_dir():
            out += from_dir(p)
            continue
        if not p.exists():
            raise DataError(f"{p}: does not exist")
        ref = None
        if references:
            ref = reference_text(references[i])
        elif p.with_suffix(".txt").exists():
            ref = p.with_suffix(".txt").read_text().strip()
        out.append(LiveInput(p.stem, p, ref))
    return out
