"""Fit preset constants to microbenchmark measurements, and run those benchmarks on CUDA.

Fits (docs/simulator.md: calibration fits presets to measurements):

- :func:`fit_transfer` — ``t = alpha + B / beta`` over a 4 KiB..1 GiB copy sweep, weighted
  least squares on relative error (small copies fix alpha, large ones beta);
- :func:`fit_layer_decode` — one decoder layer's decode time vs KV length, ``t = t0 + s * n``:
  ``t0`` gives the achieved weight-streaming efficiency, ``s`` the KV-read efficiency;
- per-call host overhead is the median host time of one ``cudaMemcpyAsync`` / kernel launch.

:func:`measure_cuda` produces a :class:`Measurements` (JSON-serialisable) on a CUDA machine;
:func:`fit_gpu_preset` turns measurements + a base preset into a new preset file.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.sim.presets import GpuPreset, ModelPreset, load_preset_file


class CalibrationError(ValueError):
    """Measurements that cannot be fitted (one-line message)."""


@dataclass
class Measurements:
    """Raw microbenchmark results (times in microseconds, sizes in bytes)."""

    sizes: list[int]
    h2d_pinned_us: list[float]
    d2h_pinned_us: list[float]
    h2d_pageable_us: list[float]
    d2h_pageable_us: list[float]
    memcpy_call_us: float
    kernel_launch_us: float
    min_kernel_us: float
    layer_model: str
    kv_lengths: list[int]
    layer_decode_us: list[float]
    environment: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "measurements") -> Measurements:
        names = {f.name for f in fields(cls)}
        missing = [n for n in names if n not in data and n != "environment"]
        if missing:
            raise CalibrationError(f"{where}: field {sorted(missing)[0]!r}: missing")
        return cls(**{k: v for k, v in data.items() if k in names})


def fit_transfer(sizes: list[int] | np.ndarray, times_us: list[float] | np.ndarray) -> tuple[float, float]:
    """Fit ``t = alpha + B / beta``; returns (alpha in us, beta in GB/s).

    Weighted least squares with weights 1/t (relative error), so a 4 KiB copy and a 1 GiB copy
    count alike.
    """
    b = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    if b.shape != t.shape or b.size < 2:
        raise CalibrationError("transfer sweep: need >= 2 (size, time) pairs of equal length")
    if (t <= 0).any() or (b <= 0).any():
        raise CalibrationError("transfer sweep: sizes and times must be > 0")
    w = 1.0 / t
    A = np.stack([np.ones_like(b), b], axis=1) * w[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if inv_beta <= 0:
        raise CalibrationError("transfer sweep: time does not grow with size")
    return max(float(alpha), 0.0), float(1.0 / inv_beta / 1e3)  # B/us -> GB/s


def fit_layer_decode(
    kv_lengths: list[int] | np.ndarray, times_us: list[float] | np.ndarray, model: ModelPreset,
    hbm_bandwidth_gbps: float,
) -> tuple[float, float]:
    """Fit ``t = t0 + s * n_kv``; returns (hbm_efficiency, kv_read_efficiency) in (0, 1].

    ``t0`` streams the layer's weights; ``s`` reads one KV position of all the layer's KV-heads.
    """
    n = np.asarray(kv_lengths, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    if n.size < 2 or n.shape != t.shape:
        raise CalibrationError("layer sweep: need >= 2 (kv length, time) pairs of equal length")
    s, t0 = np.polyfit(n, t, 1)
    bw = hbm_bandwidth_gbps * 1e3  # B/us
    weight_eff = model.layer_weight_bytes / (max(t0, 1e-9) * bw)
    kv_per_pos = model.n_kv_heads * model.kv_bytes_per_head_token
    kv_eff = kv_per_pos / (max(s, 1e-12) * bw)
    return float(min(max(weight_eff, 1e-3), 1.0)), float(min(max(kv_eff, 1e-3), 1.0))


def fit_gpu_fields(meas: Measurements, base: GpuPreset, model: ModelPreset) -> dict[str, float]:
    """Preset fields refitted from ``meas`` (the rest stay as in ``base``)."""
    a_h, b_h = fit_transfer(meas.sizes, meas.h2d_pinned_us)
    _, b_d = fit_transfer(meas.sizes, meas.d2h_pinned_us)
    a_hp, b_hp = fit_transfer(meas.sizes, meas.h2d_pageable_us)
    _, b_dp = fit_transfer(meas.sizes, meas.d2h_pageable_us)
    hbm_eff, kv_eff = fit_layer_decode(meas.kv_lengths, meas.layer_decode_us, model,
                                       base.hbm_bandwidth_gbps)
    return {
        "pcie_latency_us": a_h,
        "pcie_h2d_pinned_gbps": b_h,
        "pcie_d2h_pinned_gbps": b_d,
        "pcie_h2d_pageable_gbps": b_hp,
        "pcie_d2h_pageable_gbps": b_dp,
        "pageable_extra_us": max(a_hp - a_h, 0.0),
        "memcpy_api_us": meas.memcpy_call_us,
        "kernel_launch_us": meas.kernel_launch_us,
        "min_kernel_us": meas.min_kernel_us,
        "hbm_efficiency": hbm_eff,
        "kv_read_efficiency": kv_eff,
    }


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(round(v, 6)) if isinstance(v, float) else str(v)
    return json.dumps(str(v))


def write_gpu_preset(
    path: str | Path, base: GpuPreset, fitted: dict[str, float], meas: Measurements, name: str,
    command: str,
) -> GpuPreset:
    """Write a new GPU preset: ``base`` with ``fitted`` fields, sources and the environment."""
    base_src = __import__("tomllib").loads(Path(base.source_file).read_text())["sources"]
    values = {f.name: getattr(base, f.name) for f in fields(GpuPreset) if f.name != "source_file"}
    values.update(fitted)
    values["name"] = name
    values["description"] = f"{base.description} (calibrated: {meas.environment.get('gpu', '?')})"
    lines = [f"# Calibrated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    lines.append("\n[sources]")
    for k in values:
        if k in ("name", "description"):
            continue
        src = (f"measured by {command} ({meas.environment.get('gpu', '?')})" if k in fitted
               else base_src.get(k, "from base preset"))
        lines.append(f"{k} = {json.dumps(src)}")
    lines.append("\n[environment]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in meas.environment.items()]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return load_preset_file("gpus", out)


# --------------------------------------------------------------------------- CUDA benchmarks


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


def environment() -> dict[str, Any]:
    import subprocess

    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": str(torch.version.cuda),
                           "host": platform.node(), "python": platform.python_version()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = "?"
    return env


def _time_copy(dst, src, reps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def host_us_per_call(call, sync, calls: int = 2000, burst: int = 64, clock=time.perf_counter) -> float:
    """Median host time of one ``call()`` in µs, timed in bursts of ``burst`` calls after a
    ``sync()``.

    One long timed loop also times whatever happens once, such as the first launch of a kernel
    loading its module: 2,000 ``add_`` launches timed as one loop on a fresh process read
    19.8 µs each on an H100 VM where the steady cost is 4.8-5.0 µs. The median over bursts
    leaves such one-off costs out, and a burst shorter than the device's launch queue never
    waits for a free slot.
    """
    per_call = []
    for _ in range(max(1, calls // burst)):
        sync()
        t0 = clock()
        for _ in range(burst):
            call()
        per_call.append((clock() - t0) * 1e6 / burst)
    sync()
    return float(np.median(per_call))


def measure_cuda(model: ModelPreset, quick: bool = False, log=print) -> Measurements:
    """Run the microbenchmarks on GPU 0 (a few minutes; ``quick`` for a shorter sweep)."""
    import torch

    dev = torch.device("cuda:0")
    sizes = [2**e for e in range(12, 31, 2)]  # 4 KiB .. 1 GiB
    res: dict[str, list[float]] = {k: [] for k in ("h2d_p", "d2h_p", "h2d_g", "d2h_g")}
    for n in sizes:
        reps = max(2 if quick else 3, min(100 if quick else 200, 2**26 // n))
        g = torch.empty(n, dtype=torch.uint8, device=dev)
        hp = torch.empty(n, dtype=torch.uint8).pin_memory()
        hg = torch.empty(n, dtype=torch.uint8)
        res["h2d_p"].append(_time_copy(g, hp, reps))
        res["d2h_p"].append(_time_copy(hp, g, reps))
        res["h2d_g"].append(_time_copy(g, hg, reps))
        res["d2h_g"].append(_time_copy(hg, g, reps))
        log(f"copy {n:>11} B: H2D pinned {res['h2d_p'][-1]:9.1f} us, pageable {res['h2d_g'][-1]:9.1f} us")
        del g, hp, hg
    # host cost per cudaMemcpyAsync and per kernel launch (host timer, medians of short bursts)
    src = torch.empty(4096, dtype=torch.uint8).pin_memory()
    dst = torch.empty(4096, dtype=torch.uint8, device=dev)
    memcpy_call = host_us_per_call(lambda: dst.copy_(src, non_blocking=True), torch.cuda.synchronize)
    # a launch's host cost = an eager operator on the GPU - the same operator on the CPU (the
    # runtime presets' host_us_per_op is measured without launches; the engine adds this per kernel)
    x, x_cpu = torch.zeros(16, device=dev), torch.zeros(16)
    op_cuda = host_us_per_call(lambda: x.add_(1.0), torch.cuda.synchronize)
    op_cpu = host_us_per_call(lambda: x_cpu.add_(1.0), lambda: None)
    launch = max(op_cuda - op_cpu, 0.1)
    log(f"eager add_ host time: {op_cuda:.2f} us on the GPU, {op_cpu:.2f} us on the CPU")
    # device time of a minimal kernel: 200 launches captured in one CUDA graph (no host gaps)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(200):
            x.add_(1.0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    min_kernel = start.elapsed_time(end) * 1e3 / 2000
    log(f"host per cudaMemcpyAsync {memcpy_call:.2f} us, per launch {launch:.2f} us, "
        f"min kernel {min_kernel:.2f} us")
    kv_lengths = [512, 2048, 8192] if quick else [512, 2048, 8192, 32768]
    layer_us = [_layer_decode_us(model, n, dev) for n in kv_lengths]
    for n, t in zip(kv_lengths, layer_us, strict=True):
        log(f"decoder layer decode, kv {n:>6}: {t:8.1f} us")
    return Measurements(
        sizes=sizes, h2d_pinned_us=res["h2d_p"], d2h_pinned_us=res["d2h_p"],
        h2d_pageable_us=res["h2d_g"], d2h_pageable_us=res["d2h_g"], memcpy_call_us=memcpy_call,
        kernel_launch_us=launch, min_kernel_us=min_kernel, layer_model=model.name,
        kv_lengths=kv_lengths, layer_decode_us=layer_us, environment=environment(),
    )


def make_decode_layer(model: ModelPreset, n_kv: int, dev, dtype=None):
    """One Llama-style decoder layer of ``model`` decoding one token over ``n_kv`` cached
    positions (random weights). Returns ``(layer_fn, x)``; runs on any torch device."""
    import torch
    import torch.nn.functional as F

    dt = dtype or torch.bfloat16
    h, d, hq, hk, im = (model.hidden_size, model.head_dim, model.n_q_heads, model.n_kv_heads,
                        model.intermediate_size)
    w = {k: torch.randn(*s, device=dev, dtype=dt) * 0.02 for k, s in {
        "q": (hq * d, h), "k": (hk * d, h), "v": (hk * d, h), "o": (h, hq * d),
        "g": (im, h), "u": (im, h), "d": (h, im)}.items()}
    kc = torch.randn(1, hk, n_kv, d, device=dev, dtype=dt)
    vc = torch.randn(1, hk, n_kv, d, device=dev, dtype=dt)
    x = torch.randn(1, 1, h, device=dev, dtype=dt)

    def layer(x):
        y = F.rms_norm(x, (h,))
        q = (y @ w["q"].T).view(1, 1, hq, d).transpose(1, 2)
        kc[:, :, -1:] = (y @ w["k"].T).view(1, 1, hk, d).transpose(1, 2)
        vc[:, :, -1:] = (y @ w["v"].T).view(1, 1, hk, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        x = x + a.transpose(1, 2).reshape(1, 1, hq * d) @ w["o"].T
        y = F.rms_norm(x, (h,))
        return x + (F.silu(y @ w["g"].T) * (y @ w["u"].T)) @ w["d"].T

    return layer, x


def _layer_decode_us(model: ModelPreset, n_kv: int, dev, reps: int = 50) -> float:
    """GPU time of one decoder layer decoding one token over ``n_kv`` cached positions
    (CUDA-graph replay, so host launch gaps are excluded; eager events if capture fails)."""
    import torch

    layer, x = make_decode_layer(model, n_kv, dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(5):
                layer(x)
        torch.cuda.current_stream().wait_stream(side)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                layer(x)
            run = g.replay
        except RuntimeError:  # capture unsupported: fall back to eager launches
            def run():
                layer(x)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps
