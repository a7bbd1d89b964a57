"""``kvsim study table7``: WnW's hyperparameter sensitivity (WnW App. C, Table 7) end to end.

Replay part on the shipped minivox trace (few decode steps); live part on the random tiny
backbone. The δ and top-k checks are exact by construction: in the paper's accounting the
cap never binds, so the recalled segments at a step are those selected in the last δ steps
(a superset for a larger δ) among the top-k chunks (a superset for a larger k), and the
mean GPU count can only grow.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.specs import default_trace_dir
from kvsim.studies import table7
from kvsim.studies.wnw_sweep import extremes, unique_runs
from tests.test_study_table3 import _tiny_corpus

TRACE = default_trace_dir() / "minivox-test_30_60-00013.kvtrace"


def test_paper_constants_are_table_7() -> None:
    """WnW App. C, Table 7, and the defaults it holds fixed."""
    assert table7.PAPER_CHUNK == {0.96: 6.45, 1.92: 6.29, 4.00: 6.23, 5.76: 6.26, 7.68: 6.23}
    assert table7.PAPER_ANCHORS == {1: 6.22, 3: 6.23, 5: 6.18, 7: 6.20, 10: 6.21, 15: 6.23,
                                    20: 6.22}
    assert table7.PAPER_BUDGET == 0.2  # "at ~20% GPU retention"
    assert table7.PAPER_N_VOICE == 90 and table7.PAPER_N_ANCHOR == 5  # §3.4, §2.2
    assert 3 in table7.DELTAS and 3 in table7.TOP_KS and 2.0 in table7.STRIDES  # §2.3 defaults


def test_settings_on_the_papers_model_are_the_papers() -> None:
    cells = table7.table7_settings(240)
    chunk = [dict(s.params) for s in cells if s.group == "chunk size"]
    # a chunk spans two segments (§2.3): the stride is half the chunk; 4 s is the default
    assert [(p.get("chunk_seconds", 4.0), p.get("stride_seconds", 2.0)) for p in chunk] == [
        (w, w / 2) for w in table7.PAPER_CHUNK]
    anchors = [dict(s.params)["n_anchor"] for s in cells if s.group == "anchor count"]
    assert anchors == list(table7.PAPER_ANCHORS)
    assert all(dict(s.params)["n_voice"] == 90 and s.budget == 0.2 for s in cells)
    assert all(s.paper_wer is None for s in cells if s.group in ("delta", "top-k", "stride"))
    # the default configuration is one run shared by every sweep
    assert len(unique_runs(cells)) == len(cells) - 4


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("t7")
    res = CliRunner().invoke(app, ["study", "table7", str(TRACE), "--no-live", "--max-steps", "20",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_report_files_and_columns(replayed) -> None:
    for name in ("table7.md", "table7.parquet", "table7_replay.parquet", "table7.png"):
        assert (replayed / name).exists(), name
    md = (replayed / "table7.md").read_text()
    assert "4.00s (default)" in md and "6.450" in md and "per-input λ" in md
    delta_table = md.split("**Release lag δ**")[1].split("\n\n")[1]
    assert "paper WER" not in delta_table  # no paper column where the paper has none


def test_longer_lag_and_more_chunks_keep_more_on_gpu(replayed) -> None:
    data = pl.read_parquet(replayed / "table7.parquet")
    for group in ("delta", "top-k"):
        r = data.filter(pl.col("group") == group)["r_gpu"].to_numpy()
        assert np.all(np.diff(r) >= 0) and r[-1] > r[0], (group, r)


def test_anchor_sweep_moves_heads_from_tidal_to_anchor(replayed) -> None:
    data = pl.read_parquet(replayed / "table7.parquet").filter(pl.col("group") == "anchor count")
    # 90 heads: anchors {1,3,5,7,10,15,20} of 240 -> {1,1,2,3,4,6,8}; n_voice 34 stays
    assert data["anchors"].to_list() == [1, 1, 2, 3, 4, 6, 8]
    assert (data["anchors"] + data["tidal"] == 34).all()


def test_live_quick_on_the_tiny_backbone(tmp_path) -> None:
    heads = _tiny_corpus(tmp_path)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["study", "table7", "--quick", "--no-replay", "--model", "tiny",
                                   "--calibration", str(heads), "--dataset-root", str(tmp_path),
                                   "--max-new-tokens", "3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    runs = pl.read_parquet(out / "live-table7" / "runs.parquet")
    assert runs.height == len(unique_runs(extremes(table7.table7_settings(4))))
    data = pl.read_parquet(out / "table7.parquet")
    assert data.height == 10 and data["live_wer"].is_not_null().all()
