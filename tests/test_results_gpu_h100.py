"""The H100 measurements kept in docs/results/gpu-h100/ load as presets and say what
docs/results/gpu-h100.md says of them: the launch-in-op GPU file is calibrate-hw's output with
only ``kernel_launch_us`` (and its name) changed, and the CUDA runtime is the host probe's
eager row."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvsim.sim.presets import gpu_preset, runtime_preset

DIR = Path(__file__).resolve().parents[1] / "docs" / "results" / "gpu-h100"


def test_launch_in_op_preset_differs_from_the_calibrated_one_only_in_the_launch():
    written = asdict(gpu_preset(str(DIR / "h100-sxm-calibrated-v2.toml")))
    paired = asdict(gpu_preset(str(DIR / "h100-sxm-measured-launch-in-op.toml")))
    changed = {k for k in written if written[k] != paired[k]}
    assert changed <= {"name", "description", "kernel_launch_us", "sources", "source_file"}
    assert "kernel_launch_us" in changed and paired["kernel_launch_us"] < 0.01


@pytest.mark.parametrize("field, key", [
    ("ops_per_layer", "ops_per_layer"), ("kernels_per_layer", "kernels_per_layer"),
    ("host_us_per_op", "host_us_per_op"), ("step_ops", "step_ops"),
    ("step_fixed_us", "step_fixed_us"),
])
def test_cuda_runtime_is_the_host_probes_eager_row(field, key):
    rows = [json.loads(line) for line in (DIR / "hostprobe_cuda.jsonl").read_text().splitlines()]
    eager = next(r for r in rows if r["attn_implementation"] == "eager" and r["device"] == "cuda")
    rt = runtime_preset(str(DIR / "hf-eager-cuda-h100.toml"))
    assert getattr(rt, field) == pytest.approx(eager[key], rel=1e-6)
