"""``kvsim study fidelity``: the statistics on constructed data with known answers, the
departure index on constructed token lists, and the command end to end on a tiny backbone."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.studies.fidelity_stats import (
    at_risk_percentile,
    bootstrap,
    bootstrap_draws,
    budget_groups,
    clip_matrix,
    correlation_table,
    departure_index,
    departure_recall,
    level_correlation,
    predictor_table,
    rank_correlation,
    text_departure,
)
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

torch.set_num_threads(1)


def _points(n_clips: int, n_methods: int, y_of_x, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(n_clips):
        x = rng.random(n_methods)
        y = y_of_x(x, rng)
        rows += [{"clip": f"c{c}", "label": f"m{m}", "budget": 0.5, "x": x[m], "y": y[m]} for m in range(n_methods)]
    return pl.DataFrame(rows)


def test_rank_correlation_of_monotone_and_reversed_data():
    x = np.linspace(0.1, 3.0, 20)
    for coef in ("spearman", "kendall"):
        # ranks are small integers: their correlation is exact up to one float64 rounding
        assert rank_correlation(x, np.exp(x), coef) == pytest.approx(1.0, abs=1e-12)
        assert rank_correlation(x, -x**3, coef) == pytest.approx(-1.0, abs=1e-12)
    assert np.isnan(rank_correlation(x, np.ones_like(x)))  # constant: undefined, not 0


def test_every_level_of_a_perfect_monotone_relation_is_one():
    f = _points(5, 12, lambda x, rng: np.log(x))
    m, t = clip_matrix(f, "x"), clip_matrix(f, "y")
    assert m.shape == (5, 12)
    for level in ("per_clip", "pooled"):
        assert level_correlation(m, t, level) == pytest.approx(1.0, abs=1e-12)
    table = correlation_table(f, ["x"], ["y"], n_boot=50)
    assert (table["value"] > 1 - 1e-9).sum() >= 4  # per-clip and pooled, both coefficients
    assert (table.filter(pl.col("level") == "per_clip")["low"] > 1 - 1e-9).all()  # every resample is perfect


def test_within_budget_level_sees_past_the_budget():
    # WER falls with the budget, and within a budget it follows x exactly: the pooled level
    # mixes both, the within-budget level sees x's relation alone (perfect)
    rng = np.random.default_rng(0)
    rows = []
    for c in range(4):
        for b in (0.2, 0.6):
            x = rng.random(6)
            rows += [{"clip": f"c{c}", "label": f"m{m}", "budget": b, "x": x[m], "y": -b - 0.1 * x[m]} for m in range(6)]
    f = pl.DataFrame(rows)
    m, t, g = clip_matrix(f, "x"), clip_matrix(f, "y"), budget_groups(f)
    assert sorted(set(g.tolist())) == [0, 1] and len(g) == m.shape[1] == 12
    assert level_correlation(m, t, "within_budget", groups=g) == pytest.approx(-1.0, abs=1e-12)
    assert level_correlation(m, t, "pooled") > -0.5


def test_bootstrap_interval_contains_the_population_spearman():
    rho = 0.6  # bivariate normal: population Spearman = 6/pi * asin(rho / 2)
    truth = 6 / np.pi * np.arcsin(rho / 2)

    def y_of_x(x, rng):
        z = np.sqrt(2) * __import__("scipy").special.erfinv(2 * x - 1)  # x uniform -> normal
        return rho * z + np.sqrt(1 - rho**2) * rng.standard_normal(len(x))

    f = _points(40, 10, y_of_x, seed=3)
    m, t = clip_matrix(f, "x"), clip_matrix(f, "y")
    iv = bootstrap(lambda d: level_correlation(m, t, "pooled", "spearman", d), 40, bootstrap_draws(40, 400, 1))
    assert iv.low < truth < iv.high
    assert iv.high - iv.low < 0.2  # an informative interval, not a trivially wide one


def test_held_out_predictor_beats_constant_only_on_a_planted_relation():
    planted = _points(8, 30, lambda x, rng: x**2 + 0.02 * rng.standard_normal(len(x)))
    noise = _points(8, 30, lambda x, rng: rng.random(len(x)), seed=1)
    good = predictor_table(planted, ["x"], "y", n_boot=200).row(0, named=True)
    bad = predictor_table(noise, ["x"], "y", n_boot=200).row(0, named=True)
    assert good["gain_low"] > 0 and good["mae_model"] < 0.5 * good["mae_constant"]
    assert bad["gain_low"] <= 0 and bad["gain"] < 0.02


def test_departure_index_on_constructed_tokens():
    ref = [5, 6, 7, 8, 2]
    assert departure_index([5, 6, 7, 8, 2], ref) is None
    assert departure_index([5, 6, 9, 8, 2], ref) == 2
    assert departure_index([4], ref) == 0
    assert departure_index([5, 6, 7], ref) == 3  # stopped early: departs where it stopped
    assert departure_index([5, 6, 7, 8, 2, 2], ref) == 5
    prefixes = ["", "the", "the cat", "the cat sat"]
    assert text_departure("the cat sat", prefixes) is None
    assert text_departure("the cat sits", prefixes) == 2
    assert text_departure("a dog", prefixes) == 0
    # a prefix cutting a character decodes to U+FFFD; the next one resolves it
    assert text_departure("caf\u00e9 ole", ["", "caf", "caf\ufffd", "caf\u00e9", "caf\u00e9 au"]) == 3


def test_departure_recall_and_at_risk_percentile():
    recall = np.full(40, 0.9)
    recall[19] = 0.3  # step 19 produced token 20
    out = departure_recall(recall, 20)
    assert out["recall_at"] == pytest.approx(0.3)
    assert out["recall_before"] == pytest.approx((19 * 0.9 + 0.3) / 20)
    assert departure_recall(recall, None)["recall_before"] == pytest.approx(recall.mean())
    # peers are the compressed runs still on the full cache's tokens at the same step; the
    # full cache (recall 1 throughout) and runs that already left are not compared against
    runs = [recall, np.full(40, 0.5), np.full(40, 0.7), np.full(40, 0.1), np.ones(40)]
    pct = at_risk_percentile(runs, [20, None, 30, 5, None])
    assert pct[0] == 0.0  # step 19: 0.3 below both peers (0.5, 0.7)
    assert np.isnan(pct[1]) and np.isnan(pct[4])  # never leave
    assert pct[2] == 1.0  # step 29: the only peer left is 0.5 < 0.7
    assert pct[3] == 0.0  # step 4: 0.1 below 0.9, 0.5, 0.7
    tied = at_risk_percentile([np.full(5, 0.5), np.full(5, 0.5)], [2, None])
    assert tied[0] == 0.5  # a tie counts half


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    ckpt = tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())
    d = tmp_path_factory.mktemp("clips")
    for i in range(2):
        write_tone(d / f"c{i}.wav", 4.0 + i, seed=i)
        (d / f"c{i}.txt").write_text("some reference words here")
    out = tmp_path_factory.mktemp("fid") / "out"
    res = CliRunner().invoke(app, ["study", "fidelity", str(d), "--model", str(ckpt), "-p", "full,snapkv",
                                   "-b", "0.3", "--max-new-tokens", "10", "--aligner", "none",
                                   "--n-boot", "20", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_study_writes_report_and_its_numbers_agree_with_direct_computations(study):
    from kvsim.replay.engine import PolicySpec, replay_trace
    from kvsim.studies.alignment import alignment
    from kvsim.studies.fidelity_data import trace_tokens
    from kvsim.trace.reader import Trace

    for name in ("fidelity.md", "fidelity.parquet", "fidelity_correlations.parquet",
                 "fidelity_predictor.parquet", "fidelity_departure.parquet", "fidelity.html"):
        assert (study / name).exists(), name
    assert "When replay can stand in for live" in (study / "fidelity.md").read_text()
    points = pl.read_parquet(study / "fidelity.parquet")
    assert points.height == 2 * 2  # clips x (full once + snapkv@0.3)
    full = points.filter(pl.col("label") == "full")
    # live full-cache decoding reproduces the traced tokens: it never departs, recall is 1
    assert full["departure"].null_count() == 2 and (full["attn_recall"] == 1.0).all()
    live = pl.read_parquet(study / "live-fidelity" / "runs.parquet")
    for clip in ("c0", "c1"):
        trace = Trace(study / "traces" / f"{clip}.kvtrace")
        ids = live.filter((pl.col("input") == clip) & (pl.col("label") == "snapkv"))["token_ids"][0].to_list()
        row = points.filter((pl.col("clip") == clip) & (pl.col("label") == "snapkv")).row(0, named=True)
        assert row["departure"] == departure_index(ids, trace_tokens(trace))
        direct = replay_trace(trace, [PolicySpec("snapkv", 0.3)])[0]
        # the same computation on the same trace: equal to float32 batching rounding (docs/metrics.md)
        assert row["attn_recall"] == pytest.approx(direct.summary["attn_recall"], rel=1e-6)
        # per-layer output error: its mean over layers is the run's output error (float64 sums)
        assert np.mean(direct.layer_error) == pytest.approx(direct.summary["output_error"], rel=1e-12)
        layers = alignment(trace).layers
        assert row["output_error_align"] == pytest.approx(float(np.mean(direct.layer_error[layers])), rel=1e-6)
        assert row["recall_align"] == pytest.approx(float(direct.per_head_recall[layers].mean()), rel=1e-6)
    manifest = json.loads((study / "live-fidelity" / "run.json").read_text())
    assert manifest["status"] == "complete"


def test_study_reads_earlier_live_runs_and_compares_text_when_token_ids_are_missing(study, tmp_path):
    """--live-runs: a `kvsim live` folder whose rows have no token ids (runs recorded before
    they were kept) is read, its runs joined, and departures found through the text."""
    import shutil

    live = tmp_path / "live"
    shutil.copytree(study / "live-fidelity", live)
    for part in (live / "parts").glob("*.parquet"):
        pl.read_parquet(part).drop("token_ids").write_parquet(part)
    (live / "runs.parquet").unlink(missing_ok=True)
    out = tmp_path / "out"
    shutil.copytree(study / "traces", out / "traces")  # reused: same clips, same options
    clips = sorted(p for p in study.parent.parent.glob("clips*/*.wav"))
    res = CliRunner().invoke(app, ["study", "fidelity", *map(str, clips), "--model",
                                   json.loads((live / "run.json").read_text())["config"]["model"],
                                   "-p", "full,snapkv", "-b", "0.3", "--aligner", "none",
                                   "--n-boot", "20", "--live-runs", str(live), "-o", str(out)])
    assert res.exit_code == 0, res.output
    key = ["clip", "label", "budget"]
    again = pl.read_parquet(out / "fidelity.parquet").sort(key)
    first = pl.read_parquet(study / "fidelity.parquet").sort(key)
    assert again["wer"].to_list() == first["wer"].to_list()
    # the text comparison stops at the last prefix it can confirm: never after the token
    # departure, and a run departs by text exactly when it departs by tokens. (The tiny
    # backbone writes random bytes, whose cut characters the text cannot place; on minivox's
    # English the two agree, docs/studies.md.)
    for by_text, by_tokens in zip(again["departure"], first["departure"], strict=True):
        assert (by_text is None) == (by_tokens is None)
        assert by_text is None or by_text <= by_tokens


def test_bad_options_fail_in_one_line(tmp_path):
    res = CliRunner().invoke(app, ["study", "fidelity", str(tmp_path), "--live-runs", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "nope: no run.json" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["study", "fidelity", "--dataset-root", str(tmp_path / "none"), "--limit", "1"])
    assert res.exit_code == 2 and "--limit 1" in res.output
