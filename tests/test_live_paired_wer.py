"""scripts/live_paired_wer.py: paired corpus-WER differences of a live grid's methods."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tests.conftest import load_script


def _script():
    return load_script("live_paired_wer")


def _runs(rows: list[tuple[str, str, int, int]]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=["input", "label", "wer_errors", "ref_words"], orient="row")


def test_corpus_wer_and_paired_interval():
    runs = _runs([("c0", "full", 1, 10), ("c1", "full", 2, 20), ("c2", "full", 0, 30),
                  ("c0", "wnw", 3, 10), ("c1", "wnw", 2, 20), ("c2", "wnw", 6, 30)])
    table = _script().paired_table(runs, "full", n_boot=500).sort("label")
    full, wnw = table.rows(named=True)
    assert full["wer"] == pytest.approx(3 / 60) and full["diff"] == 0.0 == full["diff_low"]
    assert wnw["wer"] == pytest.approx(11 / 60) and wnw["diff"] == pytest.approx(8 / 60)
    # wnw makes at least as many errors as full on every clip: no resample can reverse it
    assert 0.0 <= wnw["diff_low"] <= wnw["diff"] <= wnw["diff_high"]


def test_ambiguous_baseline_and_missing_clips_are_one_line(tmp_path, capsys):
    script = _script()
    runs = _runs([("c0", "wnw@0.2", 1, 10), ("c0", "wnw@0.4", 1, 10), ("c1", "wnw@0.4", 1, 10)])
    with pytest.raises(ValueError, match="matches 2 methods"):
        script.paired_table(runs, "wnw")
    runs.write_parquet(tmp_path / "runs.parquet")
    assert script.main([str(tmp_path), "--baseline", "0.4"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: wnw@0.2: decoded 1 of the 2 clips" in err and err.count("\n") == 1


def test_minivox_evaluations_pair_by_clip(tmp_path, capsys):
    """`kvsim.minivox.evaluate --out` files, one adapter each, pair by (split, clip)."""
    import json

    def write(name: str, errors: list[int]) -> Path:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"split": "test_long", "id": f"c{i}", "errors": e,
                                            "ref_words": 20, "wer": e / 20}) + "\n"
                                for i, e in enumerate(errors)))
        return path

    script = _script()
    files = [write("shipped", [10, 12, 8]), write("guided", [6, 12, 9])]
    table = script.paired_table(script.read_runs(files), "guided", n_boot=200).sort("label")
    guided, shipped = table.rows(named=True)
    assert (guided["wer"], shipped["wer"]) == (pytest.approx(27 / 60), pytest.approx(30 / 60))
    assert shipped["diff"] == pytest.approx(3 / 60) and shipped["diff_low"] < shipped["diff"]
    with pytest.raises(ValueError, match="one run folder"):
        script.read_runs([files[0], tmp_path / "runs.parquet"])
    assert script.main([str(files[0]), str(write("broken", [1])), "--baseline", "guided"]) == 2
    assert "matches 0 methods" in capsys.readouterr().err


def test_a_grid_pairs_each_label_at_each_budget():
    """A table5 grid holds snapkv at four budgets: each budget is a method of its own; a label
    decoded at one budget (full, WnW's per-budget λ) keeps its name."""
    script = _script()
    rows = [("c0", "full", 1.0, 1, 10), ("c1", "full", 1.0, 1, 10),
            ("c0", "snapkv", 0.2, 5, 10), ("c1", "snapkv", 0.2, 7, 10),
            ("c0", "snapkv", 0.8, 2, 10), ("c1", "snapkv", 0.8, 1, 10),
            ("c0", "wnw(lam=2)", 0.2, 2, 10), ("c1", "wnw(lam=2)", 0.2, 2, 10)]
    runs = pl.DataFrame(rows, schema=["input", "label", "budget", "wer_errors", "ref_words"], orient="row")
    table = script.paired_table(runs, "full", n_boot=200)
    wer = dict(zip(table["label"], table["wer"], strict=True))
    assert wer == pytest.approx({"full": 0.1, "snapkv@0.2": 0.6, "snapkv@0.8": 0.15, "wnw(lam=2)": 0.2})


def test_by_split_pairs_a_split_with_its_twins_by_clip_number(tmp_path):
    """``--by-split``: every split of a file is a method and clip i of a re-spoken twin pairs
    with clip i of its source; a baseline label equal to one label is that label even where
    it lies inside others (``x:test_new`` inside ``x:test_new_train_voice``)."""
    import json

    path = tmp_path / "x.jsonl"
    recs = [("test_new", i, e) for i, e in enumerate([10, 12, 8])]
    recs += [("test_new_train_voice", i, e) for i, e in enumerate([4, 6, 8])]
    path.write_text("".join(json.dumps({"split": s, "id": f"{s}-{i:05d}", "errors": e,
                                        "ref_words": 20}) + "\n" for s, i, e in recs))
    script = _script()
    runs = script.read_runs([path], by_split=True)
    assert sorted(set(runs["input"])) == ["00000", "00001", "00002"]
    table = script.paired_table(runs, "x:test_new", n_boot=300).sort("label")
    new, twin = table.rows(named=True)
    assert new["label"] == "x:test_new" and new["diff"] == 0.0
    assert twin["wer"] == pytest.approx(18 / 60) and twin["diff"] == pytest.approx(-12 / 60)
    # the twin is never worse on any clip: no resample can reverse the sign
    assert twin["diff_low"] <= twin["diff"] <= twin["diff_high"] <= 0.0
    # without --by-split the file is one method over six (split, id) clips
    plain = script.read_runs([path])
    assert set(plain["label"]) == {"x"} and plain["input"].n_unique() == 6
    with pytest.raises(ValueError, match="evaluation .jsonl files only"):
        script.read_runs([tmp_path], by_split=True)


def test_contrast_is_the_difference_of_two_paired_differences(tmp_path, capsys):
    """--contrast A B C D: (A - B) - (C - D) of corpus WERs, resampled over the same clips
    (an arm's gap between a split and its twin, against another arm's)."""
    runs = _runs([("c0", "v:new", 6, 10), ("c1", "v:new", 4, 20), ("c2", "v:new", 9, 30),
                  ("c0", "v:twin", 2, 10), ("c1", "v:twin", 4, 20), ("c2", "v:twin", 3, 30),
                  ("c0", "c:new", 7, 10), ("c1", "c:new", 8, 20), ("c2", "c:new", 12, 30),
                  ("c0", "c:twin", 2, 10), ("c1", "c:twin", 4, 20), ("c2", "c:twin", 3, 30)])
    script = _script()
    c = script.contrast(runs, ("v:new", "v:twin", "c:new", "c:twin"), n_boot=500)
    # gaps: v (19 - 9) / 60, c (27 - 9) / 60
    assert c.value == pytest.approx(10 / 60 - 18 / 60)
    # v's gap is at most c's on every clip: no resample can reverse the sign
    assert c.low <= c.value <= c.high <= 0.0
    # a contrast of an arm with itself is exactly zero on every resample
    same = script.contrast(runs, ("v:new", "v:twin", "v:new", "v:twin"), n_boot=50)
    assert same.value == same.low == same.high == 0.0
    with pytest.raises(ValueError, match="no method 'x:new'"):
        script.contrast(runs, ("x:new", "v:twin", "c:new", "c:twin"))
    runs.write_parquet(tmp_path / "runs.parquet")
    assert script.main([str(tmp_path), "--baseline", "c:twin",
                        "--contrast", "v:new", "v:twin", "c:new", "c:twin"]) == 0
    out = capsys.readouterr().out
    assert "(v:new - v:twin) - (c:new - c:twin): -0.1333 [" in out


def test_mean_difference_averages_each_seeds_paired_difference(tmp_path, capsys):
    """--mean-difference A1 B1 A2 B2: the mean of A_i - B_i, on the same clip resamples; with
    two pairs it is half of the contrast (A1 - B1) - (B2 - A2)."""
    runs = _runs([("c0", "p9", 6, 10), ("c1", "p9", 4, 20), ("c2", "p9", 9, 30),
                  ("c0", "v9", 2, 10), ("c1", "v9", 4, 20), ("c2", "v9", 3, 30),
                  ("c0", "p10", 7, 10), ("c1", "p10", 8, 20), ("c2", "p10", 12, 30),
                  ("c0", "v10", 3, 10), ("c1", "v10", 5, 20), ("c2", "v10", 9, 30)])
    script = _script()
    one = script.mean_difference(runs, ["p9", "v9"], n_boot=400)
    assert one.value == pytest.approx((19 - 9) / 60)
    two = script.mean_difference(runs, ["p9", "v9", "p10", "v10"], n_boot=400)
    assert two.value == pytest.approx(((19 - 9) + (27 - 17)) / 120)
    c = script.contrast(runs, ("p9", "v9", "v10", "p10"), n_boot=400)
    assert (two.low, two.high) == pytest.approx((c.low / 2, c.high / 2))
    # p is at least as bad as v on every clip of both seeds: no resample reverses the sign
    assert 0.0 <= two.low <= two.value <= two.high
    with pytest.raises(ValueError, match="pairs A B, got 3"):
        script.mean_difference(runs, ["p9", "v9", "p10"])
    with pytest.raises(ValueError, match="--mean-difference: no method 'x'"):
        script.mean_difference(runs, ["x", "v9"])
    runs.write_parquet(tmp_path / "runs.parquet")
    assert script.main([str(tmp_path), "--baseline", "v9",
                        "--mean-difference", "p9", "v9", "p10", "v10"]) == 0
    assert "mean of (p9 - v9, p10 - v10): +0.1667 [" in capsys.readouterr().out
