"""``kvsim study table5``: the live WER-vs-r_GPU table beside WnW App. A, Table 5."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._options import (
    BanCyclesOption,
    HoldEndOption,
    ReadWindowOption,
    calibration_for,
)
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


def table5(
    dataset_root: DatasetRootOption = Path("data/minivox"),
    split: Annotated[str, typer.Option(help="Manifest split (test_long: the long-form analogue)")] = "test_30_60",
    limit: Annotated[int, typer.Option(help="First N clips of the split")] = 8,
    ids: Annotated[str | None, typer.Option(help="These clips instead (comma-separated ids)")] = None,
    policy: Annotated[list[str] | None, typer.Option("--policy", "-p", help="Methods, comma-separated (default: the study's ten)")] = None,
    budget: Annotated[str, typer.Option("--budget", "-b", help="Target r_GPU values")] = "0.2,0.4,0.6,0.8",
    max_new_tokens: Annotated[int, typer.Option(help="Token cap per clip: enough for the longest transcript (minivox: 1.7 per reference word + 10)")] = 300,
    max_seconds: Annotated[float | None, typer.Option(help="Crop each clip (and its reference) to this length")] = None,
    heads: Annotated[Path | None, typer.Option(help="heads.json for WnW / AudioKV; default with --model minivox: the shipped adapter's own")] = None,
    calibration_traces: Annotated[list[str] | None, typer.Option(help="Traces to fit WnW's λ per budget on (WnW §3.4); repeat or comma-separate")] = None,
    lambda_fit: LambdaFitOption = "measured",
    live_runs: Annotated[list[str] | None, typer.Option(help="Existing kvsim live run folders to read instead of decoding; repeat or comma-separate")] = None,
    runs_only: Annotated[bool, typer.Option("--runs-only", help="With --live-runs: the table of what they hold, decode nothing")] = False,
    read_window: ReadWindowOption = None,
    ban_cycles: BanCyclesOption = None,
    hold_end: HoldEndOption = None,
    model: ModelOption = "minivox",
    device: DeviceOption = "cpu",
    ray: RayOption = None,
    quick: QuickOption = False,
    out: OutOption = None,
) -> None:
    """Live truncated WER vs measured r_GPU per method on minivox, beside WnW's Table 5 (Voxtral-mini-3b and Qwen2.5-Omni-3B)."""
    from kvsim.commands._errors import err, fail
    from kvsim.commands._options import check_positive_ints, check_range, parse_decoding_options
    from kvsim.specs import parse_budgets
    from kvsim.studies.live_grid import GridSpec
    from kvsim.studies.table5 import DEFAULT_METHODS, QUICK, Table5Config, run_table5
    from kvsim.trace.schema import TraceError

    t0 = time.perf_counter()
    folder = default_out("table5", out)
    try:
        check_positive_ints(limit=limit, max_new_tokens=max_new_tokens)
        check_range("--max-seconds", max_seconds, 0, low_open=True)
        cfg = Table5Config(
            dataset_root=dataset_root, split=split, limit=limit,
            ids=option_items(ids, "--ids", "clip id") or None,
            methods=tuple(option_items(policy, "--policy", "policy")) or DEFAULT_METHODS,
            budgets=tuple(parse_budgets(budget)), max_new_tokens=max_new_tokens, max_seconds=max_seconds,
            heads=calibration_for(model, heads),
            calibration_traces=tuple(Path(p) for p in option_items(calibration_traces, "--calibration-traces", "trace")),
            lambda_fit=lambda_fit,
            live_runs=tuple(Path(p) for p in option_items(live_runs, "--live-runs", "run folder")),
            runs_only=runs_only,
            grid=GridSpec(model=model, device=device, ray=ray),
            **parse_decoding_options(read_window, ban_cycles, hold_end))
        if quick:
            for key, value in QUICK.items():
                if key != "methods" or not policy:
                    setattr(cfg, key, value)
        report = run_table5(cfg, folder, log=lambda m: err.print(m, markup=False, highlight=False))
    except (ValueError, KeyError, FileNotFoundError, TraceError) as exc:
        fail(exc)
    finish(report, folder, t0)


COMMAND = table5
