"""Merging calibration shards: the scores one run over every input would give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsim.trace.heads import read_heads, write_heads
from kvsim.tracer.calibrate import CalibrationConfig, ScoreAccumulator, merge_calibrations, ranking

L, HQ, HKV = 3, 6, 2
REPO = Path(__file__).resolve().parent.parent


def _samples(seed: int, n: int, n_voice: int):
    rng = np.random.default_rng(seed)
    return ([rng.random((L, HQ)) for _ in range(n_voice)], [rng.random((L, HKV)) for _ in range(n)])


def _write(path: Path, voice, sens, cfg=CalibrationConfig(max_tokens=16)) -> Path:
    acc = ScoreAccumulator(L, HQ, HKV, list(voice), list(sens))
    prov = acc.provenance(cfg, 12.5)
    prov.update(inputs=[f"{path.stem}-{i}" for i in range(len(sens))], answer_tokens=10 * len(sens))
    write_heads(path, acc.result("test"), "minivox", prov)
    return path


def test_merged_shards_equal_one_run_over_every_input(tmp_path):
    v1, s1 = _samples(0, 5, 4)
    v2, s2 = _samples(1, 3, 0)  # a shard where no token was aligned: VS weight 0
    v3, s3 = _samples(2, 7, 7)
    files = [_write(tmp_path / f"{n}.json", v, s) for n, v, s in (("a", v1, s1), ("b", v2, s2), ("c", v3, s3))]
    scores, prov, model = merge_calibrations(files)
    whole = ScoreAccumulator(L, HQ, HKV, v1 + v2 + v3, s1 + s2 + s3).result("all")
    # weighted means of means against one mean: equal up to float64 rounding of a few sums
    np.testing.assert_allclose(scores.voice_score, whole.voice_score, rtol=1e-13)
    np.testing.assert_allclose(scores.sensitivity, whole.sensitivity, rtol=1e-13)
    assert model == "minivox" and prov["n_samples_sensitivity"] == 15 and prov["n_samples_voice"] == 11
    assert prov["answer_tokens"] == 150 and len(prov["inputs"]) == 15 and prov["max_tokens"] == 16
    assert prov["ranking_vs_x_hs"] == ranking(whole)
    # the unweighted mean of the shards is not it (the test can tell)
    assert not np.allclose(scores.sensitivity, np.mean([read_heads(f).sensitivity for f in files], axis=0))


def test_merge_refuses_mismatched_settings_in_one_line(tmp_path):
    a = _write(tmp_path / "a.json", *_samples(0, 2, 2))
    b = _write(tmp_path / "b.json", *_samples(1, 2, 2), cfg=CalibrationConfig(max_tokens=8))
    with pytest.raises(ValueError, match=r"b\.json: max_tokens=8, not 16"):
        merge_calibrations([a, b])
    raw = json.loads(a.read_text())
    del raw["provenance"]["n_samples_voice"]
    (tmp_path / "c.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"c\.json: provenance\.n_samples_voice missing"):
        merge_calibrations([b, tmp_path / "c.json"])


def test_merge_script(tmp_path):
    a = _write(tmp_path / "a.json", *_samples(0, 2, 2))
    b = _write(tmp_path / "b.json", *_samples(1, 3, 1))
    out = tmp_path / "heads.json"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "merge_heads.py"), str(out), str(a), str(b)],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert "5 inputs (3 with aligned tokens) from 2 files" in res.stdout
    assert read_heads(out).sensitivity.shape == (L, HKV)
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "merge_heads.py"), str(out), str(tmp_path / "nope.json")],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nope.json" in bad.stderr


def test_store_heads_replaces_the_scores_and_nothing_else(tmp_path):
    """scripts/store_heads.py: the trace holds the new scores; keys, queries, values and
    positions are the same bytes; a trace of another shape is one line and left alone, and
    does not stop the others."""
    from kvsim.core.shapes import HeadScores
    from kvsim.trace import Trace
    from tests.conftest import load_script, make_trace

    mod = load_script("store_heads")
    good = make_trace(tmp_path / "good.kvtrace", seconds=3, steps=4, seed=1)
    other = make_trace(tmp_path / "other.kvtrace", preset="qwen-omni", seconds=1, steps=2, seed=2)
    before = Trace(good)
    m = before.meta.model
    keys0, values0, q0 = (np.array(before.keys(1)), np.array(before.values(1)), np.array(before.queries(1)))
    rng = np.random.default_rng(0)
    new = HeadScores(rng.random((m.n_layers, m.n_kv_heads)), rng.random((m.n_layers, m.n_kv_heads)))
    write_heads(tmp_path / "heads.json", new, m.name, {"method": "test"})
    assert mod.main(["--heads", str(tmp_path / "heads.json"), str(other), str(good)]) == 1
    after = Trace(good)
    np.testing.assert_array_equal(after.head_scores.voice_score, new.voice_score)
    np.testing.assert_array_equal(after.head_scores.sensitivity, new.sensitivity)
    for a, b in ((keys0, after.keys(1)), (values0, after.values(1)), (q0, after.queries(1))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, np.array(b))
    assert after.positions.equals(before.positions)
    assert Trace(other).head_scores is None or Trace(other).head_scores.voice_score.shape != new.voice_score.shape


def test_compare_heads_ranks_agreement_and_the_top_heads(tmp_path, capsys):
    from conftest import load_script
    compare = load_script("compare_heads")
    from kvsim.trace.heads import HeadScores
    rng = np.random.default_rng(3)
    vs, hs = rng.random((L, HKV)), rng.random((L, HKV))
    a = HeadScores(vs, hs, source="a")
    same = compare.agreement(a, HeadScores(vs.copy(), hs.copy(), source="b"), top=2)
    assert same == {"VS": 1.0, "HS": 1.0, "VS x HS": 1.0, "top-2 in common": 2}
    # every ranking reversed: correlations -1, and the top 2 of 6 heads of one are the bottom of the other
    rev = compare.agreement(a, HeadScores(1 / vs, 1 / hs, source="c"), top=2)
    assert rev["VS"] == pytest.approx(-1.0) and rev["HS"] == pytest.approx(-1.0)
    assert rev["VS x HS"] == pytest.approx(-1.0) and rev["top-2 in common"] == 0
    # a file of another model's shape: one line, exit 2
    write_heads(tmp_path / "a.json", a, "minivox")
    write_heads(tmp_path / "b.json", HeadScores(rng.random((L + 1, HKV)), rng.random((L + 1, HKV)), source="d"), "x")
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compare_heads: shapes differ") and "\n" not in err
