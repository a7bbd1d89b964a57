"""simulate_run on replay step logs, and the ``kvsim simulate`` command."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.core.steplog import STEP_LOG_COLUMNS, RunFacts
from kvsim.sim import PresetError, WorkloadError, model_preset, simulate_run


@pytest.fixture(scope="module")
def replay_runs(tmp_path_factory):
    from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
    from kvsim.synth import SynthConfig, synthesize
    from kvsim.trace import Trace, write_trace

    d = tmp_path_factory.mktemp("trace")
    data = synthesize(SynthConfig(preset="minivox", audio_seconds=40, decode_steps=20, seed=0))
    trace = Trace(write_trace(d / "t.kvtrace", data))
    return replay_trace(trace, [PolicySpec("snapkv", 0.2, {}), PolicySpec("full", 1.0, {}),
                                PolicySpec("wnw", 0.2, {}), PolicySpec("arkvale", 0.2, {})],
                        ReplayConfig())


def _facts(**kw) -> RunFacts:
    base = dict(model="voxtral-mini", n_layers=30, n_q_heads=32, n_kv_heads=8, head_dim=128,
                dtype_bytes=2, n_audio=3000, n_prefill=3030, n_decode=6, policy="wnw",
                budget=0.2, audio_tokens_per_s=12.5)
    base.update(kw)
    return RunFacts(**base)


def _log(n_steps: int, recall_tokens: int, runs: int) -> pl.DataFrame:
    L = 30
    rows = []
    for s in range(n_steps):
        tok = [recall_tokens // L] * L if s % 2 == 0 else [0] * L
        rn = [runs] * L if s % 2 == 0 else [0] * L
        rows.append(dict(
            step=s, context_tokens=3030 + s, non_audio_tokens=30 + s,
            gpu_audio_tokens=int(0.2 * 240 * 3000), cpu_audio_tokens=int(0.2 * 240 * 3000),
            read_audio_tokens=int(0.2 * 240 * 3000), h2d_tokens=sum(tok), h2d_bytes=sum(tok) * 512,
            h2d_transfers=sum(rn), h2d_tokens_by_layer=tok, h2d_transfers_by_layer=rn,
            released_tokens=0,
        ))
    return pl.DataFrame(rows, schema=STEP_LOG_COLUMNS)


def test_simulate_run_on_replayed_step_log(replay_runs):
    snap, full = replay_runs[:2]
    a = simulate_run(snap.step_log, snap.facts, "h100-sxm", "sync")
    b = simulate_run(full.step_log, full.facts, "h100-sxm", "sync")
    sa, sb = a.summary(), b.summary()
    for key in ("ms_per_token_mean", "ms_per_token_median", "peak_gpu_bytes", "h2d_mb_per_step",
                "transfer_wait_share"):
        assert key in sa
    assert sa["h2d_mb_per_step"] == 0.0 and sa["transfer_wait_share"] == 0.0
    assert sa["peak_gpu_bytes"] < sb["peak_gpu_bytes"]  # 20% of audio KV vs all of it
    kv_saved = (full.step_log["gpu_audio_tokens"][0] - snap.step_log["gpu_audio_tokens"][0]) * 256
    assert sb["peak_gpu_bytes"] - sa["peak_gpu_bytes"] == pytest.approx(kv_saved, rel=0.05)
    assert a.per_step.height == snap.step_log.height
    assert set(a.per_step.columns) >= {"step", "ms", "gpu_bytes", "h2d_bytes", "transfer_ms"}


def test_recalls_in_step_log_cost_time_and_coalescing_helps():
    log = _log(6, 30 * 400, 8)
    f = _facts()
    sync = simulate_run(log, f, "a100-80gb", "sync-run").summary()
    ovl = simulate_run(log, f, "a100-80gb", "overlap-run").summary()
    coal = simulate_run(log, f, "a100-80gb", "coalesced").summary()
    assert sync["h2d_mb_per_step"] == pytest.approx(30 * 400 * 512 * 3 / 6 / 1e6)
    assert sync["h2d_copies_per_step"] == pytest.approx(30 * 8 * 3 / 6)
    assert coal["h2d_copies_per_step"] == pytest.approx(30 * 3 / 6)
    assert sync["ms_per_token_mean"] > ovl["ms_per_token_mean"] > coal["ms_per_token_mean"]
    assert sync["transfer_wait_share"] > ovl["transfer_wait_share"]


def test_step_log_errors_are_one_line():
    f = _facts()
    with pytest.raises(WorkloadError, match="missing column 'h2d_bytes'"):
        simulate_run(_log(2, 0, 0).drop("h2d_bytes"), f)
    bad = _log(2, 0, 0).with_columns(pl.Series("h2d_tokens_by_layer", [[1, 2], [0, 0]]))
    with pytest.raises(WorkloadError, match="2 entries, expected 30 layers"):
        simulate_run(bad, f)
    with pytest.raises(PresetError, match="unknown model preset"):
        simulate_run(_log(2, 0, 0), _facts(model="tiny"))
    with pytest.raises(PresetError, match="do not match model preset"):
        simulate_run(_log(2, 0, 0), _facts(model="minivox"))


def test_empty_per_layer_lists_are_spread():
    log = _log(2, 3000, 1).with_columns(pl.Series("h2d_tokens_by_layer", [[], []], dtype=pl.List(pl.Int64)))
    res = simulate_run(log, _facts(), "h100-sxm", "sync")
    assert res.summary()["h2d_mb_per_step"] == pytest.approx(3000 * 512 / 2 / 1e6)


def _write_replay_dir(tmp_path, runs):
    from kvsim.results import write_outputs

    out = tmp_path / "replay"
    write_outputs(out, runs)
    return out


def test_cli_simulate_replay_dir(tmp_path, replay_runs):
    out = _write_replay_dir(tmp_path, replay_runs)
    r = CliRunner().invoke(app, ["simulate", str(out), "-g", "h100-sxm,a100-80gb", "-m", "sync,overlap",
                                 "-o", str(tmp_path / "sim")])
    assert r.exit_code == 0, r.output
    res = pl.read_parquet(tmp_path / "sim" / "sim_results.parquet")
    assert res.height == len(replay_runs) * 2 * 2
    assert len(list((tmp_path / "sim" / "sim_steps").glob("*.parquet"))) == res.height
    assert (res["ms_per_token_mean"] > 0).all()
    md = CliRunner().invoke(app, ["simulate", str(out), "--markdown"])
    assert md.exit_code == 0 and md.output.startswith("| name | gpu | mode |")


def test_cli_simulate_analytic_and_errors(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--model", "voxtral-mini-3b", "--gpu", "h100-sxm",
                                 "--policy", "wnw", "--tidal-heads", "35", "--retention", "0.2",
                                 "--audio-minutes", "4", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    row = pl.read_parquet(tmp_path / "sim_results.parquet").row(0, named=True)
    assert 0.03 < row["h2d_mb_per_step"] < 0.1
    r = CliRunner().invoke(app, ["simulate", "--model", "nope", "--policy", "wnw"])
    assert r.exit_code == 2 and "unknown model preset" in r.output
    r = CliRunner().invoke(app, ["simulate", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no step logs" in r.output
    r = CliRunner().invoke(app, ["simulate"])
    assert r.exit_code == 2


def test_cli_json_facts_roundtrip(tmp_path, replay_runs):
    out = _write_replay_dir(tmp_path, replay_runs)
    js = next((out / "steps").glob("*.json"))
    facts = RunFacts(**json.loads(js.read_text()))
    assert model_preset(facts.model).n_layers == facts.n_layers
    assert np.isfinite(simulate_run(pl.read_parquet(js.with_suffix(".parquet")), facts)
                       .summary()["ms_per_token_mean"])


def test_simulate_runs_table(replay_runs):
    from kvsim.sim import simulate_runs

    df = simulate_runs(replay_runs, "a100-80gb", ("sync", "overlap"))
    assert df.height == 8
    assert {"snapkv", "full"} <= set(df["policy"])
    assert (df["ms_per_token_mean"] > 0).all()


def test_cli_capacity_columns(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--model", "qwen-omni", "--policy", "snapkv", "--gpu", "h200",
                                 "--capacity", "--capacity-gib", "40", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    row = pl.read_parquet(tmp_path / "sim_results.parquet").row(0, named=True)
    assert row["max_batch"] > 100
    assert row["tokens_per_s_at_max_batch"] > row["tokens_per_s"]


def test_recalling_policies_from_the_replay_engine(replay_runs):
    """WnW (after-step recall) and ArkVale (in-layer recall) step logs drive the copy path."""
    for run in replay_runs[2:]:
        assert run.step_log["h2d_bytes"].sum() > 0, run.spec.label
        sync = simulate_run(run.step_log, run.facts, "a100-80gb", "sync").summary()
        ovl = simulate_run(run.step_log, run.facts, "a100-80gb", "overlap").summary()
        assert sync["h2d_mb_per_step"] == pytest.approx(run.summary["h2d_mb_per_step"])
        assert sync["transfer_wait_share"] > 0
        assert ovl["ms_per_token_mean"] <= sync["ms_per_token_mean"]


def _damage(steps, kind: str):
    """Damage the snapkv step log (or its RunFacts JSON) of a replay dir; returns (file, field)."""
    pq = next(steps.glob("*snapkv*.parquet"))
    js = pq.with_suffix(".json")
    facts = json.loads(js.read_text())
    if kind == "truncated parquet":
        pq.write_bytes(pq.read_bytes()[:100])
        return pq, "parquet"
    if kind == "garbage parquet":
        pq.write_bytes(b"not a parquet file at all")
        return pq, "parquet"
    if kind in ("string column", "null column", "list column"):
        log = pl.read_parquet(pq)
        col = {"string column": pl.col("gpu_audio_tokens").cast(pl.Utf8),
               "null column": pl.when(pl.col("step") == 1).then(None).otherwise(pl.col("gpu_audio_tokens")),
               "list column": pl.col("h2d_tokens_by_layer").cast(pl.List(pl.Utf8))}[kind]
        name = "h2d_tokens_by_layer" if kind == "list column" else "gpu_audio_tokens"
        log.with_columns(col.alias(name)).write_parquet(pq)
        return pq, name
    field, value = {"facts: string for int": ("n_layers", "x"), "facts: bool for int": ("head_dim", True),
                    "facts: zero layers": ("n_layers", 0), "facts: nan budget": ("budget", "NaN"),
                    "facts: number for model": ("model", 3)}[kind]
    facts[field] = value
    js.write_text(json.dumps(facts).replace('"NaN"', "NaN"))
    return js, field


@pytest.mark.parametrize("kind", ["truncated parquet", "garbage parquet", "string column", "null column",
                                  "list column", "facts: string for int", "facts: bool for int",
                                  "facts: zero layers", "facts: nan budget", "facts: number for model"])
def test_cli_damaged_step_log_is_one_line_naming_file_and_field(kind, tmp_path, replay_runs):
    out = _write_replay_dir(tmp_path, replay_runs)
    bad, field = _damage(out / "steps", kind)
    r = CliRunner().invoke(app, ["simulate", str(out), "-o", str(tmp_path / "sim")])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.exception.__class__.__name__ == "SystemExit"
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}") and field in lines[0], r.output
    assert not (tmp_path / "sim").exists()
