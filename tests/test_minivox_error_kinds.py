"""scripts/minivox_error_kinds.py: error kinds and skipped / looped passages."""

from __future__ import annotations

import math

import jiwer
import pytest

from tests.conftest import load_script


def _script():
    return load_script("minivox_error_kinds")


WORDS = [f"w{i}" for i in range(30)]


def test_a_skipped_passage_and_a_loop_are_counted_as_runs():
    kinds = _script().error_kinds
    ref = " ".join(WORDS)
    # 12 words skipped in one run, one word substituted, 3 scattered deletions
    skip = " ".join(WORDS[:5] + ["oops"] + WORDS[6:10] + WORDS[22:25] + WORDS[26:28])
    k = kinds([ref], [skip], run_words=10)
    assert k["ref_words"] == 30
    assert k["substitute"] == pytest.approx(1 / 30)
    assert k["delete"] == pytest.approx(15 / 30) and k["skipped"] == pytest.approx(12 / 30)
    assert k["insert"] == 0 and k["looped"] == 0
    # one substitution among the 18 words outside the skipped run
    assert k["misread"] == pytest.approx(1 / 18)
    # 15 output words, one wrong; the 10 before the skip hold it
    assert k["wrong_output"] == pytest.approx(1 / 15)
    assert k["wrong_before_skips"] == pytest.approx(1 / 10)
    # the rates add up to jiwer's WER
    assert k["wer"] == pytest.approx(jiwer.wer(ref, skip))
    # a 12-word loop: inserted words in one run
    loop = " ".join(WORDS[:10] + WORDS[:10] + ["x"] * 2 + WORDS[10:])
    k = kinds([ref], [loop], run_words=10)
    assert k["insert"] == pytest.approx(12 / 30) and k["looped"] == pytest.approx(12 / 30)
    assert k["delete"] == 0 and k["skipped"] == 0 and k["misread"] == 0
    assert k["wrong_output"] == pytest.approx(12 / 42) and math.isnan(k["wrong_before_skips"])
    # a run shorter than run_words is not a skip: its words count as read
    short = kinds([ref], [skip], run_words=13)
    assert short["skipped"] == 0 and short["misread"] == pytest.approx(1 / 30)
    # everything skipped: nothing read, no rate
    assert math.isnan(kinds([ref], [""], run_words=10)["misread"])


def test_shares_are_pooled_over_clips_by_reference_words():
    kinds = _script().error_kinds
    long_ref, short_ref = " ".join(WORDS), " ".join(WORDS[:10])
    k = kinds([long_ref, short_ref], [long_ref, " ".join(WORDS[:5])], run_words=5)
    assert k["ref_words"] == 40
    assert k["delete"] == pytest.approx(5 / 40) and k["skipped"] == pytest.approx(5 / 40)


def test_misread_chars_measure_how_near_the_substituted_words_are():
    kinds = _script().error_kinds
    ref = "the archivist read the reference"
    near = kinds([ref], ["the archivest read the refference"])  # spelled as heard
    far = kinds([ref], ["the artist read the resemblance"])  # other words
    assert near["misread"] == far["misread"] == pytest.approx(2 / 5)
    # archivist -> archivest: 1 edit; reference -> refference: 1 edit; over 9 + 9 letters
    assert near["misread_chars"] == pytest.approx(2 / 18)
    assert far["misread_chars"] == pytest.approx(jiwer.cer(["archivist", "reference"],
                                                           ["artist", "resemblance"]))
    assert far["misread_chars"] > 0.3
    assert math.isnan(kinds([ref], [ref])["misread_chars"])
