"""Truncated WER as in WnW §3.5: lower-case, strip punctuation except apostrophe and period,
truncate the hypothesis to 1.2x the reference length (in words), score with jiwer."""

from __future__ import annotations

import re

import jiwer

_KEEP = re.compile(r"[^a-z0-9'. ]+")


def normalise(text: str) -> str:
    """Lower-case, drop punctuation except ``'`` and ``.``, collapse whitespace."""
    t = _KEEP.sub(" ", text.lower().replace("\n", " "))
    return " ".join(t.split())


def truncate(hyp: str, ref: str, factor: float = 1.2) -> str:
    """First ``ceil(factor * len(ref words))`` words of ``hyp`` (both normalised)."""
    n = int(-(-factor * len(ref.split()) // 1))
    return " ".join(hyp.split()[:n])


def corpus_wer(refs: list[str], hyps: list[str]) -> float:
    """Corpus-level truncated WER (total errors / total reference words)."""
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    r = [normalise(x) for x in refs]
    h = [truncate(normalise(y), x) for x, y in zip(r, hyps, strict=True)]
    pairs = [(a, b) for a, b in zip(r, h, strict=True) if a]
    if not pairs:
        raise ValueError("all references are empty")
    return float(jiwer.wer([a for a, _ in pairs], [b if b else "<empty>" for _, b in pairs]))
