"""``kvsim study table3``: WnW's ablations A1–A3 (WnW §3.8, Table 3) end to end.

Replay part on the shipped minivox trace (few decode steps, to stay fast); live part on the
random tiny backbone with one short clip. The checks are properties that break when an
ablation knob is ignored or the study wires it wrongly.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import soundfile as sf
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.policies.base import HeadScores
from kvsim.specs import default_trace_dir
from kvsim.studies import table3
from kvsim.studies.wnw_sweep import PAPER_KV_HEADS, scale_heads
from kvsim.trace.heads import read_heads, write_heads

TRACE = default_trace_dir() / "minivox-test_30_60-00013.kvtrace"
HEADS = default_trace_dir().parent / "minivox" / "heads.json"


def test_paper_constants_are_table_3() -> None:
    """WnW §3.8, Table 3, transcribed row by row."""
    assert table3.PAPER_A1 == {0.1: {10: 51.92, 30: 9.78, 50: 8.09, 70: 6.31, 90: 6.76},
                               0.2: {10: 6.53, 30: 6.46, 50: 6.39, 70: 6.20, 90: 6.23}}
    assert table3.PAPER_A2 == {(30, 0.1): {"segment": 9.78, "global": 13.11},
                               (90, 0.2): {"segment": 6.23, "global": 6.27}}
    assert table3.PAPER_A3 == {"vs_hs": 9.78, "hs": 36.41, "vs": 124.66}
    assert table3.PAPER_N_ANCHOR == 5 and PAPER_KV_HEADS == 240  # §2.2; §3.4 "L×H_kv=240"


def test_head_counts_scale_to_the_models_share() -> None:
    assert [scale_heads(n, 240) for n in (10, 30, 50, 70, 90)] == [10, 30, 50, 70, 90]
    assert [scale_heads(n, 90) for n in (10, 30, 50, 70, 90)] == [4, 11, 19, 26, 34]
    assert scale_heads(5, 4) == 1  # never zero heads
    cells = table3.table3_settings(240)
    assert len(cells) == 10 + 4 + 3
    a3 = [dict(s.params) for s in cells if s.group.startswith("A3")]
    assert [p.get("triage_signal", "vs_hs") for p in a3] == ["vs_hs", "hs", "vs"]
    assert all(p["n_voice"] == 30 and p["n_anchor"] == 5 for p in a3)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("t3")
    res = CliRunner().invoke(app, ["study", "table3", str(TRACE), "--no-live", "--max-steps", "6",
                                   "--calibration-traces", str(TRACE), "--lambda-fit", "prefill",  # cheap fit
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_replay_report_files_and_paper_column(replayed) -> None:
    for name in ("table3.md", "table3.parquet", "table3_replay.parquet", "table3.html"):
        assert (replayed / name).exists(), name
    md = (replayed / "table3.md").read_text()
    assert "51.920" in md and "124.660" in md and "n_voice=11, n_anchor=2" in md
    assert "λ: fitted per setting" in md and "mean prefill r_GPU" in md  # --lambda-fit


def test_a1_tidal_heads_grow_with_n_voice_at_one_lambda(replayed) -> None:
    data = pl.read_parquet(replayed / "table3.parquet")
    for r in (0.1, 0.2):
        a1 = data.filter(pl.col("group") == f"A1 r_GPU={r:g}")
        assert a1["setting"].to_list() == ["10", "30", "50", "70", "90"]
        # anchors fixed (2 of 90), so tidal = n_voice - anchors: strictly increasing
        assert a1["tidal"].to_list() == [4 - 2, 11 - 2, 19 - 2, 26 - 2, 34 - 2]
        # §3.8 A1: more voice heads turn fixed heads into CPU-backed tidal heads "without
        # enlarging the on-GPU budget": the prefill keeps the same positions, so the λ fitted
        # per cell is one value, and only the CPU side (r_GPU+CPU) grows
        assert a1["lam"].n_unique() == 1
        assert np.all(np.diff(a1["r_gpu_cpu"].to_numpy()) > 0)
    rows = pl.read_parquet(replayed / "table3_replay.parquet")
    # λ fitted on this trace: each cell's prefill r_GPU meets its target (recalls on top)
    assert (rows["r_gpu_prefill"] <= rows["budget"] + 1e-9).all()
    assert (rows["r_gpu"] >= rows["r_gpu_prefill"] - 1e-12).all()
    assert (rows["lam_source"] == "given").all()


def test_a3_signals_choose_different_anchors_the_top_of_each_signal(replayed) -> None:
    rows = pl.read_parquet(replayed / "table3_replay.parquet")
    scores = read_heads(HEADS)
    signals = {"n_voice=11, n_anchor=2": scores.importance,
               "n_voice=11, n_anchor=2, triage_signal=hs": scores.sensitivity,
               "n_voice=11, n_anchor=2, triage_signal=vs": scores.voice_score}
    got = {}
    for params, signal in signals.items():
        row = rows.filter(pl.col("budget") == 0.1, pl.col("params") == params)
        anchors = [int(i) for i in row["anchor_heads"][0].split(",")]
        assert sorted(anchors) == sorted(np.argsort(-signal.ravel(), kind="stable")[:2].tolist())
        got[params] = tuple(sorted(anchors))
    assert len(set(got.values())) == 3  # the three signals pick three different anchor pairs


def test_a2_global_selection_keeps_the_same_prefill_total(replayed) -> None:
    rows = pl.read_parquet(replayed / "table3_replay.parquet")
    seg = rows.filter(pl.col("params") == "n_voice=11, n_anchor=2", pl.col("budget") == 0.1)
    glob = rows.filter(pl.col("params") == "n_voice=11, n_anchor=2, prefill_selection=global",
                       pl.col("budget") == 0.1)
    # same λ, same quota total: the prefill r_GPU is equal (exact integer counts / total)
    assert glob["r_gpu_prefill"][0] == seg["r_gpu_prefill"][0]
    assert glob["attn_recall"][0] != seg["attn_recall"][0]  # but other positions are kept


def _tiny_corpus(tmp_path):
    (tmp_path / "audio").mkdir()
    rng = np.random.default_rng(0)
    sf.write(str(tmp_path / "audio" / "c0.wav"), (0.1 * rng.standard_normal(16000 * 6)).astype(np.float32), 16000)
    pl.DataFrame({"id": ["c0"], "split": ["test_30_60"], "audio_path": ["audio/c0.wav"],
                  "text": ["some reference words here"]}).write_parquet(tmp_path / "manifest.parquet")
    heads = tmp_path / "heads.json"
    write_heads(heads, HeadScores(voice_score=np.array([[0.9, 0.1], [0.5, 0.3]]),
                                  sensitivity=np.array([[0.2, 0.8], [0.6, 0.1]])), "tiny")
    return heads


def _quick_live_study(study: str, corpus, heads, out) -> None:
    res = CliRunner().invoke(app, ["study", study, "--quick", "--no-replay", "--model", "tiny",
                                   "--calibration", str(heads), "--dataset-root", str(corpus),
                                   "--max-new-tokens", "4", "-o", str(out)])
    assert res.exit_code == 0, res.output


def test_live_part_on_the_tiny_backbone(tmp_path) -> None:
    out = tmp_path / "out"
    _quick_live_study("table3", tmp_path, _tiny_corpus(tmp_path), out)
    runs = pl.read_parquet(out / "live-table3" / "runs.parquet")
    settings = table3.table3_settings(4)
    from kvsim.studies.wnw_sweep import extremes, unique_runs

    assert runs.height == len(unique_runs(extremes(settings)))  # one run per distinct setting
    data = pl.read_parquet(out / "table3.parquet")
    assert data["live_wer"].is_not_null().all() and data["termination"].is_between(0, 1).all()
    # every A1 cell's measured r_GPU is its target's (per-input λ fits the prefill to it)
    a1 = data.filter(pl.col("group").str.starts_with("A1"))
    assert (a1["live_r_gpu"] >= a1["budget"] - 0.05).all()
    assert "per-input λ" in (out / "table3.md").read_text()
    # every live run is kept beside the report, named by its setting, for paired comparisons
    kept = pl.read_parquet(out / "table3_runs.parquet")
    assert kept.height == runs.height and kept["params"].is_not_null().all()
    assert set(kept["params"]) == set(data.filter(pl.col("live_wer").is_not_null())["params"])
    assert sorted(kept["wer"]) == sorted(runs["wer"])


def test_studies_sharing_an_out_folder_keep_each_others_live_runs(tmp_path) -> None:
    out, heads = tmp_path / "out", _tiny_corpus(tmp_path)
    _quick_live_study("table3", tmp_path, heads, out)
    before = (out / "live-table3" / "runs.parquet").read_bytes()
    _quick_live_study("table7", tmp_path, heads, out)
    assert (out / "live-table3" / "runs.parquet").read_bytes() == before
    assert (out / "live-table7" / "runs.parquet").exists() and (out / "table7_runs.parquet").exists()


def test_bad_options_are_one_line(tmp_path) -> None:
    res = CliRunner().invoke(app, ["study", "table3", "--no-live", "--no-replay"])
    assert res.exit_code == 2 and "leave nothing to run" in res.output
    res = CliRunner().invoke(app, ["study", "table3", "--no-live", "--calibration",
                                   str(tmp_path / "nope.json"), "-o", str(tmp_path)])
    assert res.exit_code == 2 and "nope.json" in res.output
    res = CliRunner().invoke(app, ["study", "table3", "--limit", "0"])
    assert res.exit_code == 2 and "--limit" in res.output
