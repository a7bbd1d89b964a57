"""``kvsim calibrate-hw``: microbenchmark a CUDA GPU and write a fitted GPU preset.

Without a CUDA GPU it says so and exits with status 3 (``--host-only`` still measures the
host cost of eager decoding on the CPU; ``--from-json`` refits saved measurements).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._errors import err, fail


def calibrate_hw(
    base: Annotated[str, typer.Option(help="GPU preset to start from (unfitted fields are kept)")] = "h100-sxm",
    model: Annotated[str, typer.Option(help="Model preset whose decoder layer is timed")] = "voxtral-mini-3b",
    out: Annotated[Path, typer.Option("--out", "-o", help="Preset file to write")] = Path("runs/calibrate/gpu.toml"),
    name: Annotated[str | None, typer.Option(help="Name of the new preset (default: <base>-calibrated)")] = None,
    quick: Annotated[bool, typer.Option(help="Fewer repetitions and 3 KV lengths (same 4 KiB-1 GiB sweep)")] = False,
    from_json: Annotated[Path | None, typer.Option(help="Fit saved measurements instead of measuring")] = None,
    host_only: Annotated[bool, typer.Option(help="Only measure eager-decode host cost (CPU; no GPU needed)")] = False,
    device: Annotated[str, typer.Option(help="--host-only: run the probe on this torch device (cpu or cuda)")] = "cpu",
) -> None:
    """Microbenchmark a CUDA GPU (copies 4 KiB-1 GiB, call overheads, layer decode vs KV) and write a fitted preset; exit code 3 without one."""
    from kvsim.sim.calibrate import (
        CalibrationError,
        Measurements,
        cuda_available,
        fit_gpu_fields,
        measure_cuda,
        write_gpu_preset,
    )
    from kvsim.sim.presets import PresetError

    bp, mp = _checked_presets(base, model, out, device, host_only)
    if host_only:
        _probe_host(mp, device)
        return
    try:
        if from_json is not None:
            try:
                meas = Measurements.from_json(json.loads(from_json.read_text()), str(from_json))
            except (OSError, json.JSONDecodeError) as exc:
                raise CalibrationError(f"{from_json}: cannot read measurements ({exc})") from None
            command = f"kvsim calibrate-hw --from-json {from_json}"
        else:
            if not cuda_available():
                fail("no CUDA GPU here (torch.cuda.is_available() is False): calibrate-hw needs "
                     "one. Use --host-only for the CPU host cost, or --from-json to refit saved "
                     "measurements.", code=3)
            meas = measure_cuda(mp, quick=quick, log=lambda s: err.print(s))
            out.parent.mkdir(parents=True, exist_ok=True)
            raw = out.with_suffix(".measurements.json")
            raw.write_text(json.dumps(meas.to_json(), indent=1))
            err.print(f"wrote {raw}")
            command = "kvsim calibrate-hw" + (" --quick" if quick else "")
        fitted = fit_gpu_fields(meas, bp, mp)
        preset = write_gpu_preset(out, bp, fitted, meas, name or f"{bp.name}-calibrated", command)
    except (CalibrationError, PresetError) as exc:
        fail(exc)
    for k, v in fitted.items():
        err.print(f"{k:24s} {getattr(bp, k):>10.3f} -> {v:>10.3f}")
    err.print(f"wrote {out} (preset {preset.name!r})")


def _checked_presets(base: str, model: str, out: Path, device: str, host_only: bool):
    """The GPU and model presets, after checking the options before any measurement: the
    presets exist, ``--device`` is usable (``--host-only``), else ``--out`` can be written as
    a file. One line and exit 2 otherwise."""
    from kvsim.rundir import OutDirError, check_out_file
    from kvsim.sim.presets import PresetError, gpu_preset, model_preset
    from kvsim.tracer.backbones.base import check_device_dtype

    try:
        presets = gpu_preset(base), model_preset(model)
        if host_only:
            check_device_dtype(device, "float32")
        else:
            check_out_file(out)
    except (PresetError, OutDirError, ValueError) as exc:
        fail(exc)
    return presets


def _probe_host(mp, device: str) -> None:
    """``--host-only``: print the eager-decode host cost of ``mp``'s shapes, one JSON line
    per attention implementation."""
    from kvsim.sim.hostprobe import probe_hf_eager

    for attn in ("sdpa", "eager"):
        r = probe_hf_eager(mp.n_layers, mp.n_q_heads, mp.n_kv_heads, attn=attn, device=device)
        print(json.dumps(r.to_json()))


COMMANDS = (calibrate_hw,)
