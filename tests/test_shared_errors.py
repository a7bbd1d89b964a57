"""scripts/shared_errors.py: reference words two transcribers miss, alone and in common."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

script = load_script("shared_errors")


def _records(tmp_path, name, hyps, ref="A b, c d."):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"split": s, "id": i, "ref": ref, "hyp": h}) + "\n"
                            for (s, i), h in hyps.items()))
    return path


def test_missed_words_follow_the_alignment_not_the_positions():
    assert script.missed_words("a b c d", "a b c d") == [False] * 4
    assert script.missed_words("a b c d", "x a b c d") == [False] * 4  # an insertion misses nothing
    assert script.missed_words("a b c d", "a c d") == [False, True, False, False]
    assert script.missed_words("A b, c d.", "a x c") == [False, True, False, True]
    # texts normalised as the WER normalises them: case and commas go, the period stays
    assert script.missed_words("A b, c d.", "a B c d") == [False, False, False, True]


def test_overlap_counts_words_missed_by_each_and_by_both(tmp_path):
    a = _records(tmp_path, "a", {("t", "1"): "a x c d.", ("t", "2"): "A b c d."})
    b = _records(tmp_path, "b", {("t", "1"): "a x c y", ("t", "2"): "a b z d."})
    (t,) = script.overlap(script.read(a), script.read(b)).values()
    assert t["words"] == 8
    assert (t["a"], t["b"], t["both"]) == pytest.approx((1 / 8, 3 / 8, 1 / 8))
    assert t["a_given_b_missed"] == pytest.approx(1 / 3)  # b of clip 1; not d of 1, c of 2
    assert t["a_given_b_right"] == pytest.approx(0 / 5)


def test_different_clips_or_references_are_one_line(tmp_path, capsys):
    a = _records(tmp_path, "a", {("t", "1"): "a b"})
    b = _records(tmp_path, "b", {("t", "2"): "a b"})
    with pytest.raises(SystemExit):
        script.main([str(a), str(b)])
    assert "hold different clips" in capsys.readouterr().err
    c = _records(tmp_path, "c", {("t", "1"): "a b"}, ref="other words")
    with pytest.raises(SystemExit):
        script.main([str(a), str(c)])
    assert "1: the two files' references differ" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main([str(a), str(a), "--split", "nope"])
    assert "no clips to compare" in capsys.readouterr().err


def test_a_bad_line_is_named_by_file_and_line(tmp_path, capsys):
    a = _records(tmp_path, "a", {("t", "1"): "a b"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(a.read_text() + "{not json\n")
    with pytest.raises(SystemExit):
        script.main([str(a), str(bad)])
    assert f"{bad}: line 2: not a JSON record" in capsys.readouterr().err
