"""``kvsim study table4`` on the tiny live backbone: MB/step grows with the tidal-head count
and equals the step logs' bytes, every run is simulated, step logs carry exactly to
Voxtral-mini's geometry, and the paper's Table 4 and the head-count mapping are pinned."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.core.steplog import STEP_LOG_COLUMNS, RunFacts
from tests.study_tiny import tiny_heads, tiny_manifest


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The sweep on one 20-s clip (250 audio tokens: 9 chunks, so chunk swap recalls). The
    tiny backbone has 4 KV-heads: 1 anchor, and the paper's 35 / 155 / 235 tidal heads map
    to 0 / 2 / 3; the budget 0.5 leaves room beside the anchor's full audio."""
    tmp = tmp_path_factory.mktemp("t4")
    data, heads = tiny_manifest(tmp / "data", seconds=(20.0,)), tiny_heads(tmp / "heads.json")
    res = CliRunner().invoke(app, ["study", "table4", "--dataset-root", str(data), "--model", "tiny",
                                   "--heads", str(heads), "--n-anchor", "1", "-b", "0.5", "--tidal",
                                   "35,155,235", "--max-new-tokens", "10", "--gpu", "h100-sxm",
                                   "-o", str(tmp / "out")])
    assert res.exit_code == 0, res.output
    return tmp / "out"


def test_mb_per_step_grows_with_tidal_heads_and_equals_the_step_logs(study):
    for name in ("table4.md", "table4.parquet", "table4_runs.parquet", "table4_sim.parquet", "table4.html"):
        assert (study / name).exists(), name
    conf = pl.read_parquet(study / "table4.parquet").sort("paper_tidal_heads")
    assert conf["tidal_heads"].to_list() == [0, 2, 3]
    mb = conf["h2d_mb_per_step"].to_list()
    assert mb[0] == 0.0 and 0 < mb[1] < mb[2]  # no tidal head, no recall; more tidal heads, more bytes
    sim_mb = conf["sim_h2d_mb_per_step_h100-sxm"].to_list()
    assert sim_mb[0] == 0.0 and 0 < sim_mb[1] < sim_mb[2]
    for row in conf.iter_rows(named=True):  # measured MB/step = the step log's bytes per step
        log = pl.read_parquet(next((study / "live-table4" / "steps").glob(f"*n_voice={row['n_voice']})*.parquet")))
        assert row["h2d_mb_per_step"] == pytest.approx(log["h2d_bytes"].sum() / log.height / 1e6, rel=1e-12)
    md = (study / "table4.md").read_text()
    assert "| 235 | 3 (4) |" in md and "| 19.7 | 27.8 | 1.04 |" in md


def test_every_run_is_simulated(study):
    runs = pl.read_parquet(study / "table4_runs.parquet")
    sim = pl.read_parquet(study / "table4_sim.parquet")
    assert sim.height == runs.filter(pl.col("steps") > 0).height == 3
    assert set(sim["gpu"]) == {"h100-sxm"} and (sim["sim_ms_per_token_median"] > 0).all()
    assert sim.sort("label")["steps"].to_list() == runs.sort("label")["steps"].to_list()


def test_step_log_carries_exactly_to_voxtral_geometry():
    """minivox (30 L x 3 KV-heads, 512 B per head-position in float32) -> Voxtral-mini (30 L x 8,
    bf16 d=128: 512 B): counts in multiples of 3 scale by 8/3 exactly."""
    from kvsim.sim import model_preset
    from kvsim.studies.table4 import to_geometry

    rng = np.random.default_rng(0)
    per_layer = [(3 * rng.integers(0, 20, 30)).tolist() for _ in range(4)]
    runs = [(3 * rng.integers(0, 3, 30)).tolist() for _ in range(4)]
    log = pl.DataFrame({
        "step": range(4), "context_tokens": [700] * 4, "non_audio_tokens": [40] * 4,
        "gpu_audio_tokens": [9000, 9030, 9060, 9090], "cpu_audio_tokens": [3000] * 4,
        "read_audio_tokens": [9000] * 4, "h2d_tokens": [sum(x) for x in per_layer],
        "h2d_bytes": [512 * sum(x) for x in per_layer], "h2d_transfers": [sum(x) for x in runs],
        "h2d_tokens_by_layer": per_layer, "h2d_transfers_by_layer": runs, "released_tokens": [0, 3, 0, 6],
    }, schema=STEP_LOG_COLUMNS)
    facts = RunFacts("minivox", 30, 9, 3, 64, 4, 600, 700, 4, "wnw", 0.2, 12.5)
    moved, mf = to_geometry(log, facts, model_preset("voxtral-mini-3b"))
    assert (mf.n_layers, mf.n_kv_heads, mf.head_dim, mf.dtype_bytes) == (30, 8, 128, 2)
    assert moved["h2d_tokens"].to_list() == [sum(x) * 8 // 3 for x in per_layer]
    assert moved["h2d_bytes"].to_list() == [512 * sum(x) * 8 // 3 for x in per_layer]
    assert moved["gpu_audio_tokens"].to_list() == [24000, 24080, 24160, 24240]
    assert moved["non_audio_tokens"].to_list() == [40] * 4  # per head: unchanged
    assert moved["h2d_transfers_by_layer"].to_list() == [[v * 8 // 3 for v in x] for x in runs]


def test_paper_table4_and_head_mapping_pinned():
    from kvsim.studies.table4 import PAPER_TABLE4, map_tidal

    assert PAPER_TABLE4 == {35: (0.217, 27.2, 0.05), 75: (0.214, 26.8, 0.20), 115: (0.210, 26.7, 0.40),
                            155: (0.205, 27.4, 0.62), 195: (0.201, 27.5, 0.82), 235: (0.197, 27.8, 1.04)}
    assert [map_tidal(t, 240, 5) for t in PAPER_TABLE4] == list(PAPER_TABLE4)  # Voxtral: identity
    assert [map_tidal(t, 90, 5) for t in PAPER_TABLE4] == [13, 27, 42, 56, 71, 85]  # minivox


def test_bad_options_are_one_line(tmp_path):
    res = CliRunner().invoke(app, ["study", "table4", "--tidal", "a,b", "-o", str(tmp_path)])
    assert res.exit_code == 2 and "--tidal" in res.output
    res = CliRunner().invoke(app, ["study", "table4", "--heads", str(tmp_path / "none.json"), "-o", str(tmp_path)])
    assert res.exit_code == 2 and "none.json" in res.output
