"""scripts/minivox_word_exposure.py: misread words grouped by how often training had them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import load_script

WORDS = [f"w{i}" for i in range(30)]


def _script():
    return load_script("minivox_word_exposure")


def test_groups_are_the_exposure_bands():
    group_of = _script().group_of
    assert [group_of(c) for c in (0, 1, 9, 10, 99, 100, 10**6)] == [
        "0", "1-9", "1-9", "10-99", "10-99", "100+", "100+"]
    assert [group_of(c, (5,)) for c in (0, 4, 5)] == ["0-4", "0-4", "5+"]


def test_read_words_leave_out_skipped_passages_and_match_the_misread_rate():
    s = _script()
    ref = " ".join(WORDS)
    hyp = " ".join(WORDS[:5] + ["oops"] + WORDS[6:10] + WORDS[22:25] + WORDS[26:28])
    read = s.read_words(ref, hyp, run_words=10)
    # 12 words skipped in one run are left out; 3 scattered deletions stay, unsubstituted
    assert [w for w, _ in read] == WORDS[:10] + WORDS[22:]
    assert [w for w, sub in read if sub] == ["w5"]
    kinds = load_script("minivox_error_kinds").error_kinds([ref], [hyp], run_words=10)
    assert sum(sub for _, sub in read) / len(read) == pytest.approx(kinds["misread"])


def test_misread_rates_per_group_count_each_word_once_per_reading():
    s = _script()
    heard = s.heard_counts(["w0 w0 w1", "W1, w2!"] + ["w3"] * 100)  # normalised: case, marks
    assert (heard["w0"], heard["w1"], heard["w2"], heard["w3"], heard["w4"]) == (2, 2, 1, 100, 0)
    records = [{"ref": "w0 w1 w3 w4", "hyp": "w0 x w3 y"}, {"ref": "w3 w4", "hyp": "z w4"}]
    table = s.misread_by_exposure(records, heard)
    assert list(table) == ["0", "1-9", "10-99", "100+"]
    assert table["0"] == (2, 0.5)  # w4 misread once of twice
    assert table["1-9"] == (2, 0.5)  # w0 read, w1 misread
    assert table["10-99"][0] == 0
    assert table["100+"] == (2, 0.5)


def test_the_command_prints_one_row_per_file_and_names_a_missing_split(tmp_path):
    pl.DataFrame({"split": ["train"] * 3, "text": ["w0 w1", "w0", "w2"]}).write_parquet(
        tmp_path / "m.parquet")
    ev = tmp_path / "a.jsonl"
    ev.write_text(json.dumps({"ref": "w0 w5", "hyp": "w0 w6"}) + "\n")
    script = Path(__file__).parents[1] / "scripts" / "minivox_word_exposure.py"
    cmd = [sys.executable, str(script), str(ev), "--manifest", str(tmp_path / "m.parquet")]
    out = subprocess.run(cmd + ["--heard", "train"], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[1] == "a.jsonl\t1\t1.000\t1\t0.000\t0\tnan\t0\tnan"
    bad = subprocess.run(cmd + ["--heard", "train,nope"], capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip() == f"error: {tmp_path / 'm.parquet'}: no split nope (--heard)"
