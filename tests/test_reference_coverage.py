"""scripts/reference_coverage.py: where in the reference a transcript stops matching."""

from __future__ import annotations

import json

import polars as pl

from tests.conftest import load_script

REF = " ".join(f"w{i}" for i in range(20))  # 20 distinct words, two per tenth


def _script():
    return load_script("reference_coverage")


def test_a_full_read_matches_every_tenth():
    assert _script().matched_by_tenth(REF, REF) == [2] * 10


def test_an_early_end_matches_nothing_after_it():
    first_half = " ".join(REF.split()[:10])
    assert _script().matched_by_tenth(REF, first_half) == [2] * 5 + [0] * 5


def test_a_skip_leaves_a_gap_in_the_middle_and_substitutions_count_nothing():
    words = REF.split()
    hyp = " ".join(words[:6] + ["x"] * 2 + words[14:])  # tenths 3-6 skipped, 2 words substituted
    assert _script().matched_by_tenth(REF, hyp) == [2, 2, 2, 0, 0, 0, 0, 2, 2, 2]


def test_normalisation_matches_the_wer_s():
    assert _script().matched_by_tenth("Hello, World!", "hello world", parts=2) == [1, 1]


def test_runs_parquet_and_eval_records_give_one_row_per_run(tmp_path):
    runs = pl.DataFrame({"input": ["c0", "c0"], "label": ["full", "wnw"], "budget": [1.0, 0.2],
                         "reference": [REF, REF], "hypothesis": [REF, " ".join(REF.split()[:4])],
                         "wer": [0.0, 0.8]})
    runs.write_parquet(tmp_path / "table5_runs.parquet")
    table = _script().coverage_table(_script().read_rows(tmp_path))
    assert table["matched"].to_list() == [20, 4]
    rec = {"id": "c0", "ref": REF, "hyp": REF, "wer": 0.0, "split": "test"}
    (tmp_path / "a.jsonl").write_text(json.dumps(rec) + "\n")
    assert _script().read_rows(tmp_path / "a.jsonl")["label"].to_list() == ["a"]


def test_a_file_without_the_texts_is_one_line_naming_it(tmp_path, capsys):
    pl.DataFrame({"input": ["c0"], "label": ["full"]}).write_parquet(tmp_path / "runs.parquet")
    assert _script().main([str(tmp_path / "runs.parquet")]) == 2
    err = capsys.readouterr().err
    assert "runs.parquet" in err and "hypothesis" in err and len(err.strip().splitlines()) == 1


def test_a_label_at_several_budgets_is_one_method_per_budget(tmp_path):
    runs = pl.DataFrame({"input": ["c0"] * 3, "label": ["full", "snapkv", "snapkv"],
                         "budget": [1.0, 0.2, 0.4], "reference": [REF] * 3,
                         "hypothesis": [REF] * 3, "wer": [0.0] * 3})
    runs.write_parquet(tmp_path / "runs.parquet")
    labels = _script().read_rows(tmp_path / "runs.parquet")["label"].to_list()
    assert sorted(labels) == ["full", "snapkv@0.2", "snapkv@0.4"]
