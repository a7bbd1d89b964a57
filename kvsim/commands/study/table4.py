"""``kvsim study table4``: WnW's recall cost vs tidal-head count, measured live and simulated,
beside WnW §3.9 Table 4."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._options import calibration_for
from kvsim.commands.study import (
    DatasetRootOption,
    DeviceOption,
    LambdaFitOption,
    ModelOption,
    OutOption,
    QuickOption,
    RayOption,
    default_out,
    finish,
)
from kvsim.specs import option_items


def _counts(text: str) -> tuple[int, ...]:
    """``--tidal``: non-negative integers, comma-separated (OptionError names the option)."""
    from kvsim.commands._options import OptionError

    values = option_items(text, "--tidal", "tidal-head count")
    if not all(v.isdigit() for v in values):
        raise OptionError(f"--tidal {text!r}: give non-negative integers, comma-separated")
    return tuple(int(v) for v in values)


def table4(
    dataset_root: DatasetRootOption = Path("data/minivox"),
    split: Annotated[str, typer.Option(help="Manifest split")] = "test_30_60",
    limit: Annotated[int, typer.Option(help="First N clips of the split")] = 4,
    tidal: Annotated[str, typer.Option(help="The paper's tidal-head counts (of Voxtral-mini's 240 heads), mapped to the model proportionally")] = "35,75,115,155,195,235",
    budget: Annotated[float, typer.Option("--budget", "-b", help="Target r_GPU (the paper's ~20%)")] = 0.2,
    n_anchor: Annotated[int, typer.Option(help="Anchor heads (the paper's 5)")] = 5,
    max_new_tokens: Annotated[int, typer.Option(help="Token cap per clip")] = 300,
    heads: Annotated[Path | None, typer.Option(help="heads.json of the model (WnW's head scores); default with --model minivox: the shipped adapter's own")] = None,
    calibration_traces: Annotated[list[str] | None, typer.Option(help="Traces to fit λ per tidal count on (WnW §3.4); repeat or comma-separate")] = None,
    lambda_fit: LambdaFitOption = "measured",
    gpu: Annotated[str, typer.Option("--gpu", "-g", help="GPU presets to simulate on, comma-separated")] = "h100-sxm,a100-80gb",
    sim_model: Annotated[str, typer.Option(help="Model preset whose geometry the step logs are simulated on")] = "voxtral-mini-3b",
    runtime: Annotated[str, typer.Option(help="Host runtime preset of the simulation")] = "hf-eager",
    model: ModelOption = "minivox",
    device: DeviceOption = "cpu",
    ray: RayOption = None,
    quick: QuickOption = False,
    out: OutOption = None,
) -> None:
    """WnW at r_GPU ~0.2 with the tidal-head count swept: measured r_GPU, ms/token and MB/step live, and each run simulated on Voxtral-mini-3b's geometry and a GPU preset, beside WnW's Table 4."""
    from kvsim.commands._errors import err, fail
    from kvsim.commands._options import check_positive_ints, check_range
    from kvsim.studies.live_grid import GridSpec
    from kvsim.studies.table4 import QUICK, Table4Config, run_table4
    from kvsim.trace.schema import TraceError

    t0 = time.perf_counter()
    folder = default_out("table4", out)
    try:
        check_positive_ints(limit=limit, max_new_tokens=max_new_tokens)
        check_range("--budget", budget, 0, 1, low_open=True)
        check_range("--n-anchor", n_anchor, 0)
        counts = _counts(tidal)
        cfg = Table4Config(
            dataset_root=dataset_root, split=split, limit=limit, tidal=counts, budget=budget,
            n_anchor=n_anchor, max_new_tokens=max_new_tokens, heads=calibration_for(model, heads),
            calibration_traces=tuple(Path(p) for p in option_items(calibration_traces, "--calibration-traces", "trace")),
            lambda_fit=lambda_fit,
            gpus=tuple(option_items(gpu, "--gpu", "gpu")), sim_model=sim_model, runtime=runtime,
            grid=GridSpec(model=model, device=device, ray=ray))
        if quick:
            for key, value in QUICK.items():
                setattr(cfg, key, value)
        report = run_table4(cfg, folder, log=lambda m: err.print(m, markup=False, highlight=False))
    except (ValueError, KeyError, FileNotFoundError, TraceError) as exc:
        fail(exc)
    finish(report, folder, t0)


COMMAND = table4
