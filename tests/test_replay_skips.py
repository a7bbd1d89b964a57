"""A policy that cannot run on one trace: skipped (budget below one page) or an error (head
scores missing or of another model); the other runs go on either way."""

from __future__ import annotations

import json

import polars as pl
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.minivox import SHIPPED_HEADS
from kvsim.specs import default_trace_dir

runner = CliRunner()
SYNTH = default_trace_dir() / "synth-qwen-omni-5s.kvtrace"  # 125 audio tokens
MINIVOX = default_trace_dir() / "minivox-test_30_60-00013.kvtrace"


def test_a_budget_below_one_page_is_skipped_and_the_run_completes(tmp_path) -> None:
    res = runner.invoke(app, ["replay", str(MINIVOX), str(SYNTH), "-p", "arkvale,snapkv",
                              "-b", "0.2", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    skipped = [line for line in res.output.splitlines() if line.startswith("skipped:")]
    assert len(skipped) == 1 and "synth-qwen-omni-5s" in skipped[0] and "arkvale@0.2" in skipped[0]
    rows = pl.read_parquet(tmp_path / "results.parquet")
    assert sorted(zip(rows["trace"], rows["policy"], strict=True)) == [
        ("minivox-test_30_60-00013", "arkvale"), ("minivox-test_30_60-00013", "snapkv"),
        ("synth-qwen-omni-5s", "snapkv")]
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["status"] == "complete"
    assert [len(e["skipped"]) for e in manifest["completed"].values()] == [0, 1]


def test_head_scores_of_another_model_are_an_error_not_a_skip(tmp_path) -> None:
    res = runner.invoke(app, ["replay", str(SYNTH), "-p", "snapkv,wnw", "-b", "0.4",
                              "--calibration", str(SHIPPED_HEADS), "-o", str(tmp_path)])
    assert res.exit_code == 1
    assert "wnw@0.4" in res.output and "(30, 3)" in res.output and "skipped:" not in res.output
    rows = pl.read_parquet(tmp_path / "results.parquet")
    assert rows["policy"].to_list() == ["snapkv"]


def test_a_folder_without_traces_is_named(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(app, ["replay", str(empty), "-o", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert f"{empty}: no *.kvtrace found" in res.output.replace("\n", "")
