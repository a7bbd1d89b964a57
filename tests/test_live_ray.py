"""``kvsim live --ray`` and ``live_grid`` on Ray give the run folder a local run gives.

One local Ray serves every test of the file (starting it and its workers takes tens of
seconds); it is shut down at the end. Both sides decode on one thread (``OMP_NUM_THREADS=1``
here, Ray's one CPU per task in the workers) with the same seeded tiny backbone, so every
number is the same computation and is compared exactly, except the wall-clock timings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import soundfile as sf
from polars.testing import assert_frame_equal
from typer.testing import CliRunner

from kvsim.cli import app

#: Wall-clock timings: measured afresh by every run, the only columns allowed to differ.
TIMING = ("wall_s", "transform_s", "prefill_s", "ms_per_token", "ms_per_token_median", "policy_seconds")
#: wnw has no calibration here: skipped, and said once for the run however many tasks find it
METHODS = ["-p", "full,snapkv,streaming,wnw", "-b", "0.3", "--max-new-tokens", "8", "--no-plot"]


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray (2 CPUs) for the whole file, whose workers import this checkout's kvsim."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    import kvsim.live.remote as here

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    there = ray.get(ray.remote(num_cpus=1)(_remote_file).remote())
    if Path(there) != Path(here.__file__):
        ray.shutdown()
        pytest.skip(f"Ray workers import kvsim.live from {there}, not this checkout's {here.__file__}")
    yield ray
    ray.shutdown()


def _remote_file() -> str:
    import kvsim.live.remote

    return kvsim.live.remote.__file__


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """Three 4 s noise clips with references."""
    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    for i in range(3):
        sf.write(str(root / f"c{i}.wav"), (0.1 * rng.standard_normal(16000 * 4)).astype(np.float32), 16000)
        (root / f"c{i}.txt").write_text("some reference words here")
    return root


@pytest.fixture(scope="module")
def local_run(clips, tmp_path_factory) -> Path:
    """The in-process run every Ray run is compared with."""
    out = tmp_path_factory.mktemp("local") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        res = CliRunner().invoke(app, ["live", str(clips), "--model", "tiny", *METHODS, "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _assert_same_run(a: Path, b: Path) -> None:
    """Same runs.parquet and results.parquet but for TIMING; same step logs and run facts."""
    for name in ("runs.parquet", "results.parquet"):
        x, y = pl.read_parquet(a / name), pl.read_parquet(b / name)
        assert x.columns == y.columns
        drop = [c for c in TIMING if c in x.columns]
        assert_frame_equal(x.drop(drop), y.drop(drop), check_exact=True)
    steps = sorted(p.name for p in (a / "steps").iterdir())
    assert steps == sorted(p.name for p in (b / "steps").iterdir()) and steps
    for name in steps:
        if name.endswith(".parquet"):
            assert_frame_equal(pl.read_parquet(a / "steps" / name), pl.read_parquet(b / "steps" / name),
                               check_exact=True)
        else:
            assert json.loads((a / "steps" / name).read_text()) == json.loads((b / "steps" / name).read_text())


def test_live_on_ray_gives_the_local_run(ray_local, clips, local_run, tmp_path):
    out = tmp_path / "ray"
    res = CliRunner().invoke(app, ["live", str(clips), "--model", "tiny", *METHODS, "-o", str(out),
                                   "--ray", "local"])
    assert res.exit_code == 0, res.output
    assert res.output.count("skipping wnw") == 1, res.output
    _assert_same_run(local_run, out)
    runs = pl.read_parquet(out / "runs.parquet")
    assert runs["input"].to_list() == [f"c{i}" for i in range(3) for _ in range(3)]  # input order
    assert runs["hypothesis"].n_unique() > 1  # the methods decode differently: a real comparison
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "complete" and set(manifest["completed"]) == {"c0", "c1", "c2"}
    assert all(len(e["steps"]) == 3 for e in manifest["completed"].values())


def test_ray_resumes_a_run_and_isolates_a_bad_input(ray_local, clips, local_run, tmp_path):
    """A run interrupted after c0 is resumed on Ray: c0 is kept, an unreadable input fails in
    one line, and the others complete as in the local run."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for p in clips.iterdir():
        (inputs / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    first = CliRunner().invoke(app, ["live", str(inputs), "--model", "tiny", *METHODS, "-o", str(out),
                                     "--ids", "c0"])
    assert first.exit_code == 0, first.output
    (inputs / "bad.wav").write_bytes(b"not audio at all")
    (inputs / "bad.txt").write_text("words")
    part = next((out / "parts").iterdir())
    stamp = part.stat().st_mtime_ns
    res = CliRunner().invoke(app, ["live", str(inputs), "--model", "tiny", *METHODS, "-o", str(out),
                                   "--ray", "local", "--resume"])
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if "bad.wav" in line]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert part.stat().st_mtime_ns == stamp  # c0 kept, not decoded again
    manifest = json.loads((out / "run.json").read_text())
    assert manifest["status"] == "failed" and list(manifest["failed"]) == ["bad"]
    assert set(manifest["completed"]) == {"c0", "c1", "c2"}
    _assert_same_run(local_run, out)


def test_live_grid_on_ray_equals_local(ray_local, clips, tmp_path):
    from kvsim.live.data import from_paths
    from kvsim.live.decode import LiveConfig
    from kvsim.live.run import make_plan
    from kvsim.studies.live_grid import GridSpec, live_grid

    items = from_paths([clips], None)
    plan = make_plan(["full,snapkv"], [0.3])
    frames = [live_grid(items, plan, LiveConfig(max_new_tokens=6), tmp_path / name,
                        GridSpec(model="tiny", ray=ray), log=lambda m: None)
              for name, ray in (("local", None), ("ray", "local"))]
    assert frames[0].height == 3 * 2
    drop = [c for c in TIMING if c in frames[0].columns]
    assert_frame_equal(frames[0].drop(drop), frames[1].drop(drop), check_exact=True)
    assert json.loads((tmp_path / "ray" / "run.json").read_text())["status"] == "complete"


def test_bad_model_and_missing_ray_are_one_line(ray_local, clips, tmp_path, monkeypatch):
    res = CliRunner().invoke(app, ["live", str(clips), "--model", "nosuch", "--ray", "local",
                                   "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--model nosuch: not a known name" in res.output
    assert not (tmp_path / "o").exists()  # rejected before any work
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    res = CliRunner().invoke(app, ["live", str(clips), "--model", "tiny", "--ray", "local",
                                   "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--ray needs Ray: pip install 'kvsim[ray]'" in res.output


def test_worker_keeps_one_model_and_gpu_tasks_ask_for_a_gpu():
    from kvsim.live.remote import ModelSpec, task_resources, worker_model

    tiny = ModelSpec("tiny")
    lm = worker_model(tiny)
    assert worker_model(ModelSpec("tiny")) is lm  # loaded once, kept for the next task
    assert worker_model(ModelSpec("tiny:1")) is not lm
    assert task_resources(ModelSpec("tiny", device="cuda")) == {"num_gpus": 1, "max_calls": 0}
    assert task_resources(tiny) == {"num_cpus": 1}


def test_lambda_fits_on_ray_equal_local_and_keep_their_warnings(ray_local, tmp_path, monkeypatch):
    """`kvsim study table3/table7 --ray`: one λ fit per setting as a Ray task gives the local
    λ exactly (the same replays), and a fit's warning reaches the driver's collector."""
    from kvsim.policies.wnw import WnWBudgetWarning
    from kvsim.studies.wnw_lambda import CalibrationSet, calibration_contexts
    from kvsim.studies.wnw_sweep import CollectedWarnings, Setting, fit_lambdas
    from kvsim.synth import SynthConfig, synthesize
    from kvsim.trace.writer import write_trace

    path = write_trace(tmp_path / "calib.kvtrace", synthesize(SynthConfig(
        preset="small", audio_seconds=20.0, decode_steps=24, seed=0, store_values=False)))
    params = (("n_voice", 4), ("n_anchor", 1))
    # 0.2 is infeasible here (the anchor alone keeps ~0.3): the fit warns and returns λ = 0
    settings = [Setting("g", str(b), b, params) for b in (0.2, 0.5, 0.7)]
    fits = {}
    for ray in (None, "local"):
        if ray:  # the workers fit (their own import of kvsim); the driver must not
            monkeypatch.setattr(CalibrationSet, "lam", lambda *a, **k: pytest.fail("fitted locally"))
        with CollectedWarnings() as caught:
            fits[ray] = fit_lambdas(settings, calibration_contexts([path], None), ray)
        assert any("measured r_GPU is already" in m for m in caught.messages), ray
    assert fits["local"] == fits[None]
    assert fits[None][settings[0].key] == 0.0 < fits[None][settings[1].key] < fits[None][settings[2].key]
    with pytest.warns(WnWBudgetWarning):
        calibration_contexts([path], None).lams([(0.2, dict(params)), (0.5, dict(params))], "local")
