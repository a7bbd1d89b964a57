"""``kvsim study table5`` on the tiny live backbone: the table is aggregate() of the runs it
reads, the paper's Table 5 is pinned, a live folder is reused (only what it lacks is
decoded), and WnW's λ is fitted per budget on calibration traces."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.live.run import aggregate
from tests.study_tiny import tiny_heads, tiny_manifest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def live_folder(tmp_path_factory):
    """A `kvsim live` folder (tiny backbone, 2 clips, full/snapkv/arkvale at 0.3 and 0.6) whose
    WER counts are then set to distinct known values, so the table has something to get wrong."""
    tmp = tmp_path_factory.mktemp("t5")
    data, heads = tiny_manifest(tmp / "data"), tiny_heads(tmp / "heads.json")
    res = CliRunner().invoke(app, ["live", str(data), "--dataset", "manifest", "--split", "test_30_60",
                                   "--model", "tiny", "-p", "full,snapkv,arkvale", "-b", "0.3,0.6",
                                   "--calibration", str(heads), "--max-new-tokens", "6", "--no-plot",
                                   "-o", str(tmp / "runs")])
    assert res.exit_code == 0, res.output
    runs = pl.read_parquet(tmp / "runs" / "runs.parquet")
    errors = np.arange(runs.height) % 5
    runs = runs.with_columns(wer_errors=pl.Series(errors), wer=pl.Series(errors / runs["ref_words"].to_numpy()))
    runs.write_parquet(tmp / "runs" / "runs.parquet")
    return tmp, data, heads, runs


def _study(args: list[str]) -> None:
    res = CliRunner().invoke(app, ["study", "table5", "--model", "tiny", "--max-new-tokens", "6",
                                   "-b", "0.3,0.6", *args])
    assert res.exit_code == 0, res.output


def test_table_equals_aggregate_of_the_runs(live_folder):
    tmp, _, heads, runs = live_folder
    out = tmp / "out_runs_only"
    _study(["--live-runs", str(tmp / "runs"), "--runs-only", "--heads", str(heads), "-o", str(out)])
    for name in ("table5.md", "table5.parquet", "table5_runs.parquet", "table5_paper.parquet", "table5.html"):
        assert (out / name).exists(), name
    got = pl.read_parquet(out / "table5.parquet").sort("label", "budget")
    want = aggregate(runs).sort("label", "budget")
    for col in ("wer", "r_gpu", "r_gpu_cpu", "r_gpu_vs_original", "termination_rate", "h2d_mb_per_step"):
        assert got[col].to_list() == pytest.approx(want[col].to_list(), rel=1e-12), col
    assert len(set(want["wer"].to_list())) > 2  # the known WERs differ between methods
    md = (out / "table5.md").read_text()
    snap = want.filter(pl.col("label") == "snapkv").sort("budget", descending=True)
    assert f"| snapkv | {100 * snap['wer'][0]:.2f} | {100 * snap['wer'][1]:.2f} |" in md
    ark = want.filter(pl.col("label") == "arkvale").sort("budget", descending=True)
    assert f"{ark['r_gpu_vs_original'][1]:.2f} / {ark['r_gpu_cpu'][1]:.2f}, 0%" in md


def test_paper_table5_pinned_and_printed(live_folder):
    from kvsim.studies import table5 as t5

    assert t5.PAPER_VOXTRAL_TEST_CLEAN["wnw"] == (6.72, 6.71, 6.64, 6.23)
    assert t5.PAPER_VOXTRAL_TEST_CLEAN["full"] == (6.79,)
    assert t5.PAPER_VOXTRAL_TEST_OTHER["arkvale"] == (8.83, 8.85, 9.79, 14.75)
    assert t5.PAPER_QWEN_TEST_CLEAN["audiokv"] == (14.24, 14.54, 28.31, 131.30)
    assert t5.PAPER_QWEN_TEST_OTHER["adakv"] == (52.92, 98.70, 115.53, 119.86)
    assert t5.PAPER_WNW_RETENTION[("Voxtral-mini-3b", "test-clean")] == (
        (79.79, 59.96, 40.91, 22.25), (79.79, 59.96, 40.91, 41.52))
    assert t5.PAPER_WNW_RETENTION[("Qwen2.5-Omni-3B", "test-other")][1][-1] == 42.03
    md = (live_folder[0] / "out_runs_only" / "table5.md").read_text()
    assert "| 6.72 | 6.71 | 6.64 | 6.23 | 14.72 | 14.90 | 14.88 | 15.31 |" in md  # WnW row
    assert "| 79.79 | 59.96 | 40.91 | 41.52 | 80.26 | 60.12 | 40.23 | 41.81 |" in md  # r_GPU+CPU
    assert pl.read_parquet(live_folder[0] / "out_runs_only" / "table5_paper.parquet").height == 4 * (1 + 4 * 4 + 2 * 4)


def test_reuses_the_folder_and_decodes_only_what_it_lacks(live_folder):
    tmp, data, heads, runs = live_folder
    out = tmp / "out_mixed"
    _study(["--dataset-root", str(data), "--live-runs", str(tmp / "runs"), "-p", "full,snapkv,wnw",
            "--heads", str(heads), "-o", str(out)])
    fresh = pl.read_parquet(out / "live-table5" / "runs.parquet")
    assert set(fresh["policy"]) == {"wnw"} and fresh.height == 2 * 2  # clips x budgets
    table = pl.read_parquet(out / "table5_runs.parquet")
    kept = table.filter(pl.col("policy") != "wnw").sort("label", "budget", "input")
    # every run of the folder is in the table, unchanged (arkvale too, though not asked for)
    assert kept["wer"].to_list() == runs.sort("label", "budget", "input")["wer"].to_list()
    assert "decoded by this study: wnw@0.3, wnw@0.6" in (out / "table5.md").read_text()


def test_lambda_per_budget_plan():
    from kvsim.policies.wnw_calibrate import fit_lambda
    from kvsim.studies.table5 import Table5Config, build_plan
    from kvsim.studies.wnw_lambda import calibration_contexts
    from kvsim.trace.heads import read_heads

    trace = ROOT / "traces" / "minivox-test_30_60-00013.kvtrace"
    scores = read_heads(ROOT / "minivox" / "heads.json")
    # the prefill fit (cheap); the measured default: tests/test_wnw_lambda_measured.py
    cfg = Table5Config(methods=("full", "wnw", "snapkv"), budgets=(0.2, 0.4, 0.8),
                       calibration_traces=(trace,), lambda_fit="prefill")
    plan = build_plan(cfg, scores)
    wnw = [p for p in plan if p.spec.name == "wnw"]
    assert [p.spec.budget for p in wnw] == [0.2, 0.4, 0.8]  # one item per budget
    ctxs = calibration_contexts([trace], scores, "prefill")
    lams = [fit_lambda(ctxs, b) for b in (0.2, 0.4, 0.8)]
    assert [p.spec.params["lam"] for p in wnw] == pytest.approx(lams, rel=1e-5)  # printed to 6 digits
    assert lams[0] < lams[1] < lams[2]  # a larger target keeps more: a larger λ
    assert len([p for p in plan if p.spec.name == "snapkv"]) == 3 and len(plan) == 1 + 3 + 3


def test_bad_inputs_are_one_line(tmp_path):
    res = CliRunner().invoke(app, ["study", "table5", "--live-runs", str(tmp_path), "--runs-only",
                                   "--model", "tiny", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "not a kvsim run folder" in res.output
    res = CliRunner().invoke(app, ["study", "table5", "--runs-only", "--model", "tiny", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--runs-only needs --live-runs" in res.output


def test_missing_runs_are_grouped_by_input():
    """A folder still being filled: clip b lacks more than clip a; each is decoded only for
    what it lacks."""
    from kvsim.live.run import make_plan
    from kvsim.studies.table5 import missing_groups

    plan = make_plan(["full", "snapkv"], [0.2])
    runs = pl.DataFrame({"input": ["a", "a"], "transform": ["none"] * 2, "label": ["full", "snapkv"],
                         "budget": [1.0, 0.2]})
    assert missing_groups(plan, runs, ["a"]) == []
    groups = missing_groups(plan, runs.head(1), ["a", "b", "c"])
    assert [([p.spec.label for p in g], ids) for g, ids in groups] == [
        (["snapkv"], ["a"]), (["full", "snapkv"], ["b", "c"])]
    assert missing_groups(plan, None, ["a"])[0][1] == ["a"]


def test_a_run_still_going_is_read_from_its_finished_parts(live_folder, tmp_path):
    import json
    import shutil

    from kvsim.studies.live_runs import read_live_runs

    tmp, *_ = live_folder
    going = tmp_path / "going"
    shutil.copytree(tmp / "runs", going)
    manifest = json.loads((going / "run.json").read_text())
    first = manifest["inputs"][0]
    manifest.update(status="running", completed={first: manifest["completed"][first]})
    (going / "run.json").write_text(json.dumps(manifest))
    (going / "runs.parquet").unlink()
    got = read_live_runs(going)  # the part of the one finished clip, not runs.parquet
    want = pl.read_parquet(going / manifest["completed"][first]["part"])
    assert set(got["input"]) == {first} and got.height == want.height
    res = CliRunner().invoke(app, ["study", "table5", "--live-runs", str(going), "--runs-only", "--model", "tiny",
                                   "--max-new-tokens", "7", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "config field 'max_new_tokens' is 6" in res.output


def test_lambda_note_reads_the_runs_labels_when_no_fit_was_made():
    """--runs-only over WnW runs decoded with a given λ: the notes name those λ, not a per-input fit."""
    import polars as pl

    from kvsim.studies.table5 import Table5Info, run_lambdas, table5_notes

    runs = pl.DataFrame({"input": ["a", "a", "a"], "label": ["wnw:lam=3.05694", "wnw(lam=19.2912)", "snapkv"],
                         "budget": [0.2, 0.4, 0.2]})
    assert run_lambdas(runs) == {0.2: 3.05694, 0.4: 19.2912}
    text = " ".join(table5_notes(runs, Table5Info(inputs=["a"], lambdas={0.2: None, 0.4: None})))
    assert "λ = 3.05694" in text and "λ = 19.2912" in text and "per-input" not in text
    assert "policy labels" in text
    fitted = " ".join(table5_notes(runs, Table5Info(inputs=["a"], lambdas={0.2: 1.5}, lambda_fit="measured")))
    assert "λ = 1.5" in fitted and "measured r_GPU" in fitted


def test_a_cap_below_a_complete_transcript_is_said():
    """The cap is checked against each clip's reference words times the tokens per word of the
    runs that ended by themselves (here 10 tokens for 5 words: 2 per word): a clip of 40
    reference words needs ~80 tokens, so a cap of 60 cuts it and a cap of 80 does not."""
    from kvsim.studies.table5 import Table5Info, cap_note, table5_notes

    runs = pl.DataFrame({
        "input": ["a", "b", "a", "b"], "label": ["full", "full", "snapkv", "snapkv"], "budget": [1.0, 1.0, 0.2, 0.2],
        "terminated": [True, True, False, False], "tokens": [4, 6, 60, 60],
        "length_ratio": [2 / 20, 3 / 40, 60 / 20, 1 / 40], "ref_words": [20, 40, 20, 40]})
    note = cap_note(runs, 60)
    assert note.startswith("Warning: the token cap (--max-new-tokens 60) is below what a complete "
                           "transcript needs on 1 of 2 clips (b; up to ~80 tokens at the 2.00")
    assert note in " ".join(table5_notes(runs, Table5Info(inputs=["a", "b"], max_new_tokens=60)))
    assert cap_note(runs, 80) is None and cap_note(runs, None) is None
    assert cap_note(runs.with_columns(pl.lit(False).alias("terminated")), 10) is None  # nothing to measure on
    assert all("token cap" not in n for n in table5_notes(runs, Table5Info(inputs=["a", "b"], max_new_tokens=80)))
