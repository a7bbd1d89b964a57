"""Quality metrics of live decoding: truncated WER (WnW §3.5) and sacreBLEU.

WnW §3.5: "We report truncated WER after light text normalization (lower-casing and removal of
all punctuation except apostrophe and period): each hypothesis is first truncated to 1.2x the
ground-truth token length and then scored against the reference. [...] Substitutions/deletions/
insertions are computed with the jiwer library."

kvsim's default follows those words (:class:`WerConfig`):

* ``unit="token"``: the hypothesis is cut to ``floor(1.2 * len(tokenizer(reference)))`` tokens
  of the model's own tokenizer (both texts as the model and the dataset give them, before
  normalisation) and decoded back. A hypothesis then keeps as many *words* as fit in that many
  tokens, so a looping run of short words scores above 1.2: the bound is
  ``1.2 * (reference tokens per word) / (hypothesis tokens per word)``. The paper's 199.24 %
  (Ada-KV, Table 5), 196.01 % and 124.66 % (Table 3, A3) exceed 1.2, which word truncation
  cannot produce. ``unit="word"`` (the first ``floor(1.2 * reference words)`` normalised words,
  WER <= 1.2) is the option.
* Averaging: ``averaging="corpus"`` pools the edit operations of all utterances over all
  reference words, which is what jiwer computes when handed the lists of references and
  hypotheses; ``averaging="utterance"`` is the mean of per-utterance WERs (the option).

The hyp/ref length ratio is computed before truncation, so a non-terminating run shows up there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_PUNCT = re.compile(r"[^\w\s'.]", flags=re.UNICODE)
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})

UNITS = ("token", "word")
AVERAGING = ("corpus", "utterance")


class TextTokenizer(Protocol):
    """What token truncation needs of a tokenizer (any Hugging Face tokenizer qualifies)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class WerConfig:
    """How truncated WER is computed (defaults: WnW §3.5).

    Parameters
    ----------
    factor : float
        Truncation ratio: the hypothesis keeps ``factor`` x the reference length (1.2, §3.5).
    unit : str
        ``token`` (reference length in the model's tokenizer tokens, the paper's words) or
        ``word`` (normalised words; bounds WER at ``factor``).
    averaging : str
        ``corpus`` (errors of all utterances / reference words of all utterances, as jiwer over
        the lists) or ``utterance`` (mean of per-utterance WERs).
    """

    factor: float = 1.2
    unit: str = "token"
    averaging: str = "corpus"

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"WER unit must be one of {UNITS}, got {self.unit!r}")
        if self.averaging not in AVERAGING:
            raise ValueError(f"WER averaging must be one of {AVERAGING}, got {self.averaging!r}")
        if not self.factor > 0:
            raise ValueError(f"WER truncation factor must be positive, got {self.factor}")


def normalize(text: str) -> str:
    """Lower-case, drop punctuation except ``'`` and ``.`` (typographic apostrophes count as
    apostrophes), collapse whitespace (WnW §3.5). Dropped punctuation becomes a space, so
    ``well-known`` is two words."""
    text = _PUNCT.sub(" ", text.translate(_APOSTROPHES).lower()).replace("_", " ")
    return " ".join(text.split())


def truncate_words(hyp: str, ref: str, factor: float = 1.2) -> str:
    """First ``floor(factor * len(ref words))`` words of ``hyp`` (the ``word`` option)."""
    n = int(factor * len(ref.split()))
    return " ".join(hyp.split()[:n])


def truncate_tokens(hyp: str, ref: str, tokenizer: TextTokenizer, factor: float = 1.2) -> str:
    """``hyp`` cut to ``floor(factor * len(tokenizer(ref)))`` tokens and decoded back (WnW §3.5:
    "truncated to 1.2x the ground-truth token length"); no special tokens are added."""
    n = int(factor * len(tokenizer.encode(ref, add_special_tokens=False)))
    ids = list(tokenizer.encode(hyp, add_special_tokens=False))
    if len(ids) <= n:
        return hyp
    return tokenizer.decode(ids[:n], skip_special_tokens=True)


@dataclass(frozen=True)
class TextScores:
    wer: float  #: truncated WER of this utterance
    wer_untruncated: float
    length_ratio: float  #: hyp words / ref words, before truncation
    ref_words: int
    hyp_words: int
    errors: int  #: substitutions + deletions + insertions after truncation (corpus pooling)


def _truncated(hyp: str, ref: str, cfg: WerConfig, tokenizer: TextTokenizer | None) -> str:
    """The normalised, truncated hypothesis."""
    if cfg.unit == "word":
        return truncate_words(normalize(hyp), normalize(ref), cfg.factor)
    if tokenizer is None:
        raise ValueError("token-truncated WER (WnW §3.5) needs the model's tokenizer; "
                         "pass one or use WerConfig(unit='word')")
    return normalize(truncate_tokens(hyp, ref, tokenizer, cfg.factor))


def truncated_wer(hyp: str, ref: str, tokenizer: TextTokenizer | None = None,
                  cfg: WerConfig | None = None) -> TextScores:
    """Truncated WER of one hypothesis against its reference (WnW §3.5)."""
    import jiwer

    cfg = cfg or WerConfig()
    r, h = normalize(ref), normalize(hyp)
    if not r:
        raise ValueError("reference text is empty after normalisation")
    out = jiwer.process_words(r, _truncated(hyp, ref, cfg, tokenizer))
    errors = out.substitutions + out.deletions + out.insertions
    return TextScores(
        wer=errors / len(r.split()),
        wer_untruncated=float(jiwer.wer(r, h)),
        length_ratio=len(h.split()) / len(r.split()),
        ref_words=len(r.split()),
        hyp_words=len(h.split()),
        errors=errors,
    )


def corpus_wer(hyps: Sequence[str], refs: Sequence[str], tokenizer: TextTokenizer | None = None,
               cfg: WerConfig | None = None) -> float:
    """Truncated WER of a set of utterances, pooled or averaged as ``cfg.averaging`` says."""
    cfg = cfg or WerConfig()
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not refs:
        raise ValueError("no utterances to score")
    scores = [truncated_wer(h, r, tokenizer, cfg) for h, r in zip(hyps, refs, strict=True)]
    return average_wer([s.errors for s in scores], [s.ref_words for s in scores], cfg.averaging)


def average_wer(errors: Sequence[int], ref_words: Sequence[int], averaging: str = "corpus") -> float:
    """Corpus WER (sum of errors / sum of reference words) or the mean per-utterance WER."""
    if averaging == "corpus":
        return float(sum(errors)) / float(sum(ref_words))
    if averaging == "utterance":
        return float(sum(e / n for e, n in zip(errors, ref_words, strict=True))) / len(errors)
    raise ValueError(f"WER averaging must be one of {AVERAGING}, got {averaging!r}")


def bleu(hyp: str, ref: str) -> float:
    """Sentence-level sacreBLEU (0-100) for translation outputs."""
    import sacrebleu

    return float(sacrebleu.sentence_bleu(hyp, [ref]).score)


def corpus_bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)
