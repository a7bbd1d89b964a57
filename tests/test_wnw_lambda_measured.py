"""WnW's λ fitted on the measured (decode-time, recalls included) r_GPU (WnW §3.4).

The fit replays WnW at candidate λ over synthetic calibration traces with decode steps.
r_GPU is a mean of integer token counts divided by integer totals, computed the same way for
the fit and for the re-measurement here, so comparisons against the fit's own numbers are
exact; comparisons against the target carry only the fit's 1e-12 float slack.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.policies import _wnw_layout
from kvsim.policies.registry import make
from kvsim.policies.wnw import WnWBudgetWarning
from kvsim.policies.wnw_calibrate import fit_lambda
from kvsim.replay.wnw_lambda import (
    calibration_replayers,
    fit_lambda_measured,
    measured_r_gpu,
    search_lambda_measured,
)
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace.reader import Trace
from kvsim.trace.writer import write_trace

PARAMS = {"n_voice": 4, "n_anchor": 1}  # small preset: 2 KV-heads × 4 layers; 1 anchor recalls
ROOT = Path(__file__).resolve().parents[1]


def _trace(tmp: Path, seed: int, steps: int) -> Path:
    data = synthesize(SynthConfig(preset="small", audio_seconds=20.0, decode_steps=steps,
                                  seed=seed, store_values=False))
    return write_trace(tmp / f"calib-{seed}-{steps}.kvtrace", data)


@pytest.fixture(scope="module")
def replayers(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("calib")
    return calibration_replayers([Trace(_trace(tmp, seed, 24)) for seed in (0, 1)], None)


@pytest.mark.parametrize("target", [0.4, 0.6, 0.8])
def test_fitted_lambda_is_at_most_the_target_and_within_one_step(replayers, target) -> None:
    fit = search_lambda_measured(replayers, target, **PARAMS)
    (again,) = measured_r_gpu(replayers, target, [fit.lam], **PARAMS)
    assert again == fit.r_gpu <= target + 1e-12  # replays are deterministic
    assert 0 < fit.step < fit.lam_prefill / 100  # 4 passes of 7 intervals: 1/2401 of the range
    (above,) = measured_r_gpu(replayers, target, [fit.lam + fit.step], **PARAMS)
    assert above > target  # one search step further overshoots: the largest λ under the target


def test_a_larger_target_gives_a_larger_lambda(replayers) -> None:
    lams = [search_lambda_measured(replayers, r, **PARAMS).lam for r in (0.4, 0.5, 0.6)]
    assert lams[0] < lams[1] < lams[2]


def test_prefill_fit_is_above_the_measured_fit_when_recalls_happen(replayers) -> None:
    fit = search_lambda_measured(replayers, 0.4, **PARAMS)
    prefill = fit_lambda([r.ctx for r in replayers], 0.4, **PARAMS)
    (at_prefill,) = measured_r_gpu(replayers, 0.4, [prefill], **PARAMS)
    assert at_prefill > 0.4  # recalls come on top of the prefill retention
    assert prefill == fit.lam_prefill > fit.lam


def test_infeasible_target_warns_and_keeps_lambda_zero(replayers) -> None:
    with pytest.warns(WnWBudgetWarning, match="measured r_GPU is already"):
        fit = search_lambda_measured(replayers, 0.2, **PARAMS)  # the anchor alone keeps ~0.3
    assert fit.lam == 0.0 and fit.r_gpu > 0.2 and fit.step == 0.0


def test_traces_without_decode_steps_are_refused_in_one_line(tmp_path: Path) -> None:
    path = _trace(tmp_path, 0, 1)
    with pytest.raises(ValueError, match="needs traces with decode steps") as err:
        fit_lambda_measured([path], 0.4, **PARAMS)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/wnw_fit_lambda.py"), "-b", "0.4",
                           "-p", "n_voice=4", "-p", "n_anchor=1", str(path)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "needs traces with decode steps" in proc.stderr


def test_script_default_is_the_measured_fit_and_prefill_stays_an_option(tmp_path: Path) -> None:
    path = _trace(tmp_path, 0, 24)
    fits = {}
    for how in ("measured", "prefill"):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts/wnw_fit_lambda.py"), "-b",
                               "0.4", "--fit", how, "-p", "n_voice=4", "-p", "n_anchor=1",
                               str(path)], capture_output=True, text=True, check=True)
        fits[how] = proc.stdout
    expected = fit_lambda_measured([path], 0.4, **PARAMS)
    assert fits["measured"].startswith(f"-b 0.4 -p wnw:lam={expected:.6g}:")
    assert fits["measured"] != fits["prefill"]


def test_paper_constants_are_unchanged() -> None:
    """WnW §2.2 and App. F hyperparameters stay the defaults; the fit only chooses λ."""
    pol = make("wnw", 0.2)
    assert (pol.n_anchor, pol.chunk_seconds, pol.stride_seconds, pol.top_k, pol.delta) == (
        5, 4.0, 2.0, 3, 3)
    assert (pol.min_per_segment, pol.budget_mode, pol.lam) == (0, "paper", None)
    assert _wnw_layout.PAPER_VOICE_FRACTION == (
        (0.2, 90 / 240), (0.4, 50 / 240), (0.6, 30 / 240), (0.8, 30 / 240))


def test_studies_fit_on_the_measured_r_gpu_by_default(tmp_path: Path) -> None:
    from kvsim.studies.wnw_lambda import calibration_contexts, wnw_items
    from kvsim.studies.wnw_sweep import Setting, fit_lambdas

    path = _trace(tmp_path, 0, 24)
    measured = fit_lambda_measured([path], 0.4, **PARAMS)
    prefill = fit_lambda([r.ctx for r in calibration_replayers([path], None)], 0.4, **PARAMS)
    for fit, lam in (("measured", measured), ("prefill", prefill)):
        how = {} if fit == "measured" else {"fit": fit}  # measured: the default
        calib = calibration_contexts([path], None, **how)
        (item,) = wnw_items([0.4], calib, **PARAMS)
        assert item.spec.params["lam"] == pytest.approx(lam, rel=1e-5)  # printed to 6 digits
        setting = Setting("A1", "x", budget=0.4, params=tuple(PARAMS.items()))
        assert fit_lambdas([setting], calib) == {setting.key: lam}


def test_no_recall_room_returns_the_prefill_fit(replayers) -> None:
    """At r = 1 the prefill fit keeps everything, so nothing is recalled: its λ is the fit."""
    fit = search_lambda_measured(replayers, 1.0, **PARAMS)
    assert fit.lam == fit.lam_prefill > 0 and fit.r_gpu == 1.0 and fit.step == 0.0
