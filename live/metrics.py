"""Live mode's text metrics are :mod:`kvsim.wer`'s (one definition of truncated WER for live
mode, studies and minivox's own evaluation)."""

from kvsim.wer import (  # noqa: F401
    AVERAGING,
    UNITS,
    TextScores,
    TextTokenizer,
    WerConfig,
    average_wer,
    bleu,
    corpus_bleu,
    corpus_wer,
    normalize,
    truncate_tokens,
    truncate_words,
    truncated_wer,
)
