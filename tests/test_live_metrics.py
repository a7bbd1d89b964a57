"""Truncated WER (WnW §3.5) and BLEU."""

from __future__ import annotations

import pytest

from tracer.live.metrics import bleu, corpus_wer, normalize, truncate_words, truncated_wer


def test_normalize_keeps_apostrophes_and_periods():
    assert normalize("Hello, World! It's 3.5 p.m.; OK?") == "hello world it's 3.5 p.m. ok"
    assert normalize("  a\tb\nc  ") == "a b c"


def test_truncation_to_1_2_times_reference_words():
    ref = "one two three four five six seven eight nine ten"
    assert truncate_words(" ".join(["x"] * 30), ref) == " ".join(["x"] * 12)


def test_truncated_wer_ignores_a_runaway_tail():
    ref = "the cat sat on the mat"
    hyp = "the cat sat on the mat " + "and so on " * 50  # did not terminate
    s = truncated_wer(hyp, ref)
    assert s.wer == pytest.approx(1 / 6)  # 7 words kept: one insertion
    assert s.wer_untruncated > 20
    assert s.length_ratio == pytest.approx((6 + 150) / 6)


def test_truncated_wer_counts_errors_by_hand():
    s = truncated_wer("The dog sat, on a mat.", "the cat sat on the mat.")
    assert s.wer == pytest.approx(2 / 6)  # two substitutions
    assert truncated_wer("", "a b").wer == 1.0
    with pytest.raises(ValueError, match="empty"):
        truncated_wer("a", "!!!")


def test_corpus_wer_and_bleu():
    assert corpus_wer(["a b c", "d e"], ["a b c", "d x"]) == pytest.approx(1 / 5)
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(100.0)
    assert bleu("a completely different sentence", "the cat sat on the mat") < 10
