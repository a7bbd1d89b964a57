"""Calibration fitting on fixture measurements, and calibrate-hw without a GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.sim import gpu_preset, model_preset
from kvsim.sim.calibrate import (
    CalibrationError,
    Measurements,
    cuda_available,
    fit_gpu_fields,
    fit_layer_decode,
    fit_transfer,
)

SIZES = [2**e for e in range(12, 31, 2)]  # 4 KiB .. 1 GiB


def _sweep(alpha, gbps, noise=0.03, seed=0):
    rng = np.random.default_rng(seed)
    t = np.array([alpha + b / (gbps * 1e3) for b in SIZES])
    return (t * (1 + noise * rng.standard_normal(len(t)))).tolist()


@pytest.mark.parametrize(("alpha", "gbps"), [(2.0, 25.0), (5.5, 48.0), (12.0, 11.0)])
def test_fit_transfer_recovers_alpha_and_beta(alpha, gbps):
    a, b = fit_transfer(SIZES, _sweep(alpha, gbps))
    assert a == pytest.approx(alpha, rel=0.1)
    assert b == pytest.approx(gbps, rel=0.05)


def test_fit_transfer_exact_without_noise():
    a, b = fit_transfer(SIZES, _sweep(3.0, 30.0, noise=0.0))
    assert a == pytest.approx(3.0, rel=1e-6) and b == pytest.approx(30.0, rel=1e-6)


def test_fit_transfer_rejects_bad_input():
    with pytest.raises(CalibrationError):
        fit_transfer([4096], [3.0])
    with pytest.raises(CalibrationError):
        fit_transfer([4096, 8192], [3.0, -1.0])
    with pytest.raises(CalibrationError, match="does not grow"):
        fit_transfer([4096, 2**20], [50.0, 10.0])


def test_fit_layer_decode_recovers_efficiencies():
    m = model_preset("voxtral-mini-3b")
    bw = 3350.0
    eff_w, eff_kv = 0.8, 0.55
    kv = np.array([512, 2048, 8192, 32768])
    t0 = m.layer_weight_bytes / (eff_w * bw * 1e3)
    s = m.n_kv_heads * m.kv_bytes_per_head_token / (eff_kv * bw * 1e3)
    w, k = fit_layer_decode(kv, t0 + s * kv, m, bw)
    assert w == pytest.approx(eff_w, rel=1e-6) and k == pytest.approx(eff_kv, rel=1e-6)


def _fixture(tmp_path):
    m = model_preset("voxtral-mini-3b")
    kv = [512, 2048, 8192, 32768]
    t0 = m.layer_weight_bytes / (0.8 * 3350e3)
    s = m.n_kv_heads * 512 / (0.5 * 3350e3)
    data = Measurements(
        sizes=SIZES, h2d_pinned_us=_sweep(2.5, 44.0, seed=1), d2h_pinned_us=_sweep(2.5, 40.0, seed=2),
        h2d_pageable_us=_sweep(9.0, 18.0, seed=3), d2h_pageable_us=_sweep(9.0, 16.0, seed=4),
        memcpy_call_us=3.1, kernel_launch_us=2.7, min_kernel_us=1.9, layer_model=m.name,
        kv_lengths=kv, layer_decode_us=[t0 + s * n for n in kv],
        environment={"gpu": "NVIDIA H100 80GB HBM3 (fixture)", "driver": "550.0", "cuda": "12.4",
                     "torch": "2.13.0"},
    ).to_json()
    p = tmp_path / "meas.json"
    p.write_text(json.dumps(data))
    return p


def test_fit_gpu_fields_on_fixture(tmp_path):
    meas = Measurements.from_json(json.loads(_fixture(tmp_path).read_text()))
    f = fit_gpu_fields(meas, gpu_preset("h100-sxm"), model_preset("voxtral-mini-3b"))
    assert f["pcie_h2d_pinned_gbps"] == pytest.approx(44.0, rel=0.05)
    assert f["pcie_h2d_pageable_gbps"] == pytest.approx(18.0, rel=0.05)
    assert f["pageable_extra_us"] == pytest.approx(6.5, abs=1.5)
    assert f["hbm_efficiency"] == pytest.approx(0.8, rel=1e-3)
    assert f["kv_read_efficiency"] == pytest.approx(0.5, rel=1e-3)
    assert f["memcpy_api_us"] == 3.1


def test_cli_refits_fixture_and_writes_valid_preset(tmp_path):
    out = tmp_path / "cal.toml"
    r = CliRunner().invoke(app, ["calibrate-hw", "--from-json", str(_fixture(tmp_path)), "-o", str(out),
                                 "--name", "h100-lab"])
    assert r.exit_code == 0, r.output
    p = gpu_preset(str(out))  # loads + validates: every number has a source
    assert p.name == "h100-lab"
    assert p.pcie_h2d_pinned_gbps == pytest.approx(44.0, rel=0.05)
    text = out.read_text()
    assert "[environment]" in text and "550.0" in text and "NVIDIA H100" in text
    # the calibrated preset drives the simulator
    from kvsim.sim import AnalyticPolicy, analytic_workload, simulate_workload

    wl = analytic_workload(model_preset("minivox"), AnalyticPolicy("full"), 10.0, n_decode=3)
    assert simulate_workload(wl, p, "sync").summary()["gpu"] == "h100-lab"


def test_cli_bad_measurements(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"sizes": [1, 2]}))
    r = CliRunner().invoke(app, ["calibrate-hw", "--from-json", str(p), "-o", str(tmp_path / "x.toml")])
    assert r.exit_code == 2 and "missing" in r.output


@pytest.mark.skipif(cuda_available(), reason="this test checks the no-GPU path")
def test_cli_without_gpu_says_so_and_fails():
    r = CliRunner().invoke(app, ["calibrate-hw"])
    assert r.exit_code == 3
    assert "no CUDA GPU" in r.output


def test_decode_layer_benchmark_body_runs_on_cpu():
    """The layer timed by calibrate-hw has the model's shapes (checked on CPU, fp32)."""
    import torch

    from kvsim.sim.calibrate import make_decode_layer

    m = model_preset("minivox")
    layer, x = make_decode_layer(m, 64, "cpu", dtype=torch.float32)
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (1, 1, m.hidden_size)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize(("args", "needle"), [
    (["--host-only", "--model", "bogus"], "unknown model preset 'bogus'"),
    (["--host-only", "--base", "bogus"], "bogus"),
    (["--host-only", "--device", "tpu"], "--device: unknown device 'tpu'"),
    (["--model", "bogus"], "unknown model preset 'bogus'"),
])
def test_cli_bad_preset_or_device_is_one_line(args, needle):
    r = CliRunner().invoke(app, ["calibrate-hw", *args])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("error: ") and needle in line, r.output


@pytest.mark.parametrize("case", ["a folder", "under a file"])
def test_cli_unwritable_out_is_refused_before_fitting(tmp_path, case):
    (tmp_path / "afile").write_text("x")
    out = tmp_path if case == "a folder" else tmp_path / "afile" / "gpu.toml"
    r = CliRunner().invoke(app, ["calibrate-hw", "--from-json", str(_fixture(tmp_path)), "-o", str(out)])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith(f"error: --out {out}: "), r.output
    assert (tmp_path / "afile").read_text() == "x"


class _FakeDevice:
    """A fake GPU: a call costs the host ``cost_us``, the first one ``first_us`` more (a
    kernel's module loaded on its first launch); beyond ``depth`` pending calls each call
    waits ``wait_us`` for a queue slot. Time runs on a fake clock."""

    def __init__(self, cost_us=1.0, first_us=0.0, depth=10**9, wait_us=20.0):
        self.cost_us, self.first_us, self.depth, self.wait_us = cost_us, first_us, depth, wait_us
        self.now_us, self.pending, self.calls, self.syncs = 0.0, 0, 0, 0

    def call(self) -> None:
        self.pending += 1
        self.calls += 1
        self.now_us += self.wait_us if self.pending > self.depth else self.cost_us
        self.now_us += self.first_us if self.calls == 1 else 0.0

    def sync(self) -> None:
        self.pending, self.syncs = 0, self.syncs + 1

    def clock(self) -> float:
        return self.now_us / 1e6


@pytest.mark.parametrize("device", [
    dict(first_us=30_000.0),        # a one-off cost in the first call
    dict(depth=100, wait_us=20.0),  # a launch queue that fills
])
def test_host_cost_per_call_leaves_out_one_off_and_queueing_costs(device):
    from kvsim.sim.calibrate import host_us_per_call

    dev = _FakeDevice(**device)
    assert host_us_per_call(dev.call, dev.sync, calls=2000, burst=64, clock=dev.clock) == pytest.approx(1.0)
    assert dev.syncs == 2000 // 64 + 1 and dev.calls == 2000 // 64 * 64
    # the single timed loop the first calibration used reads several times the cost
    dev = _FakeDevice(**device)
    assert host_us_per_call(dev.call, dev.sync, calls=2000, burst=2000, clock=dev.clock) > 15.0
