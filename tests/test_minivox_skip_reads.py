"""scripts/minivox_skip_reads.py: skipped passages, where the text leaves and returns, and
whether the read path jumped with it."""

from __future__ import annotations

import numpy as np

from tests.conftest import load_script

WORDS = [f"w{i}" for i in range(40)]


def _script():
    return load_script("minivox_skip_reads")


def test_a_skip_with_a_loop_inside_is_one_passage_left_and_returned_at_matched_words():
    find = _script().find_skips
    # w0-w9 read, then "and x" (landing on the passage's "and" and a word after it), then
    # back at w30-w39: the passage w10-w29 is one skip, not two
    ref = WORDS[:10] + WORDS[10:12] + ["and"] + WORDS[13:30] + WORDS[30:]
    hyp = WORDS[:10] + ["and", "x"] + WORDS[30:]
    (skip,) = find(ref, hyp, run_words=10)
    assert (skip.ref_start, skip.ref_end) == (10, 30)
    assert (skip.leave_word, skip.leave_ref) == (10, 9)  # the text leaves after w9
    assert (skip.return_word, skip.return_ref) == (12, 30)  # and returns at w30
    # with the joining gap below what lies between the deletions: two passages, one a skip
    assert [(s.ref_start, s.ref_end) for s in find(ref, hyp, run_words=10, gap=1)] == [(14, 30)]


def test_short_deletions_and_a_skip_to_the_end_are_told_apart():
    find = _script().find_skips
    ref = WORDS
    assert find(ref, WORDS[:5] + WORDS[8:], run_words=10) == []  # 3 words: no skip
    (tail,) = find(ref, WORDS[:20], run_words=10)  # stops after w19
    assert (tail.ref_start, tail.ref_end, tail.return_word, tail.return_ref) == (20, 40, None, None)
    # a wrong word between the last matched one and the passage: the text left after w4
    (skip,) = find(ref, WORDS[:5] + ["z"] + WORDS[20:], run_words=10)
    assert (skip.ref_start, skip.ref_end, skip.leave_word, skip.leave_ref) == (6, 20, 5, 4)
    # a single matched word after the passage is not a return; three are
    (skip,) = find(ref, WORDS[:10] + ["w25"] + ["y"] * 3 + WORDS[33:], run_words=10)
    assert skip.return_ref == 33


def test_first_tokens_maps_words_to_the_token_that_starts_them():
    pieces = ["He", "llo", " big", " wor", "ld", ",", " ok"]
    starts = _script().first_tokens(list(range(len(pieces))),
                                    lambda ids: "".join(pieces[i] for i in ids))
    assert starts == [0, 2, 3, 6]  # hello, big, world, ok


def test_reference_words_split_as_the_wer_normalises_and_keep_times():
    words, start, end = _script().reference_words(["Twenty-four", "--", "hours."],
                                                  [0.0, 1.0, 2.0], [1.0, 2.0, 3.0])
    assert words == ["twenty", "four", "hours."]
    assert start.tolist() == [0.0, 0.0, 2.0] and end.tolist() == [1.0, 1.0, 3.0]


def test_classify_reads_where_the_attention_was_at_the_texts_return():
    classify = _script().classify
    # reading in order at 1 s per token up to token 20 (20 s), stuck there while the text
    # writes off the reference from token 21, then at 60 s from token 28; the text returns
    # at token 30
    read = np.concatenate([np.arange(21.0), np.full(7, 20.0), np.arange(60.0, 65.0, 0.25)])
    kind, lead, move = classify(read, 21, 30, t0=20.0, t1=60.0)
    assert kind == "read jumped too" and lead == 2 and move == 40.0
    # the reading moves through the passage at 5 s per token instead: no jump
    through = np.concatenate([np.arange(21.0), np.arange(25.0, 60.0, 5.0), np.arange(60.0, 65.0, 0.25)])
    kind, lead, move = classify(through, 21, 28, t0=20.0, t1=60.0)
    assert kind == "read went through" and move == 5.0
    # the reading stays at 20 s: the text skipped alone
    stuck = np.concatenate([np.arange(21.0), np.full(30, 20.0)])
    assert classify(stuck, 21, 30, t0=20.0, t1=60.0)[:2] == ("text only", None)
    # the reading is somewhere else entirely
    lost = np.concatenate([np.arange(21.0), np.full(30, 40.0)])
    assert classify(lost, 21, 30, t0=20.0, t1=60.0)[0] == "elsewhere"


def test_passages_with_the_same_return_are_one_skip():
    find = _script().find_skips
    # two deleted passages (w10-w21, w26-w35) with 4 words between them (two matched, two
    # substituted) and no 3 matched words in a row until w36: one skip from the first's
    # leave to w36
    ref = [f"w{i}" for i in range(50)]
    hyp = ref[:10] + ["w22", "q", "w24", "q"] + ref[36:]
    (skip,) = find(ref, hyp, run_words=10, gap=1)
    assert (skip.ref_start, skip.ref_end, skip.leave_word, skip.leave_ref) == (10, 36, 10, 9)
    assert (skip.return_ref, skip.return_word) == (36, 14)
