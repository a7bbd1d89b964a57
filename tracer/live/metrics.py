"""Quality metrics of live decoding.

Truncated WER follows WnW §3.5: lower-case both texts, strip punctuation except apostrophes and
periods, truncate the hypothesis to 1.2x the reference length in words (so a run that fails to
stop is not charged for its endless tail beyond that), score with jiwer. Translation quality is
sacreBLEU. The hyp/ref length ratio is computed before truncation, so a non-terminating run
shows up there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PUNCT = re.compile(r"[^\w\s'.]", flags=re.UNICODE)


def normalize(text: str) -> str:
    """Lower-case, drop punctuation except ``'`` and ``.``, collapse whitespace (WnW §3.5)."""
    text = _PUNCT.sub(" ", text.lower()).replace("_", " ")
    return " ".join(text.split())


def truncate_words(hyp: str, ref: str, factor: float = 1.2) -> str:
    """First ``floor(factor * len(ref words))`` words of ``hyp`` (WnW §3.5)."""
    n = int(factor * len(ref.split()))
    return " ".join(hyp.split()[:n])


@dataclass(frozen=True)
class TextScores:
    wer: float  #: truncated WER
    wer_untruncated: float
    length_ratio: float  #: hyp words / ref words, before truncation
    ref_words: int
    hyp_words: int


def truncated_wer(hyp: str, ref: str, factor: float = 1.2) -> TextScores:
    """Truncated WER of one hypothesis against its reference (WnW §3.5)."""
    import jiwer

    r, h = normalize(ref), normalize(hyp)
    if not r:
        raise ValueError("reference text is empty after normalisation")
    ht = truncate_words(h, r, factor)
    return TextScores(
        wer=float(jiwer.wer(r, ht)) if ht else 1.0,
        wer_untruncated=float(jiwer.wer(r, h)) if h else 1.0,
        length_ratio=len(h.split()) / len(r.split()),
        ref_words=len(r.split()),
        hyp_words=len(h.split()),
    )


def corpus_wer(hyps: list[str], refs: list[str], factor: float = 1.2) -> float:
    """Corpus-level truncated WER (errors summed over utterances / reference words)."""
    import jiwer

    rs = [normalize(r) for r in refs]
    hs = [truncate_words(normalize(h), r, factor) for h, r in zip(hyps, rs, strict=True)]
    return float(jiwer.wer(rs, hs))


def bleu(hyp: str, ref: str) -> float:
    """Sentence-level sacreBLEU (0-100) for translation outputs."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(hyp, [ref]).score)


def corpus_bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)
