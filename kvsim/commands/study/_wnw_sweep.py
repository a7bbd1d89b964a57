"""The options ``kvsim study table3`` and ``table7`` share (WnW sweeps: replay + live)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands.study import (
    DatasetRootOption,
    DeviceOption,
    LambdaFitOption,
    ModelOption,
    OutOption,
    QuickOption,
    RayOption,
)

TracesArg = Annotated[list[Path] | None, typer.Argument(help="Traces to replay (default: the shipped traces/minivox-*.kvtrace)")]
HeadsOption = Annotated[Path | None, typer.Option("--calibration", help="heads.json of the model (default: minivox's shipped minivox/heads.json for --model minivox, else the scores each trace carries)")]
CalibTracesOption = Annotated[list[Path] | None, typer.Option("--calibration-traces", help="Traces (or folders) to fit WnW's λ on, per setting × r_GPU (WnW §3.4); without: per-input λ")]
LimitOption = Annotated[int, typer.Option("--limit", help="Live inputs (clips, >= 1; --quick: 2)")]
MaxNewOption = Annotated[int, typer.Option("--max-new-tokens", help="Live generation cap (>= 1); a run that reaches it did not terminate")]
NoLiveOption = Annotated[bool, typer.Option("--no-live", help="Replay proxies only, no live decoding")]
NoReplayOption = Annotated[bool, typer.Option("--no-replay", help="Live decoding only, no replay")]
MaxStepsOption = Annotated[int | None, typer.Option("--max-steps", help="Replay only the first N >= 1 decode steps of each trace")]


@dataclass
class SweepArgs:
    """The command line of a WnW sweep study, before checking."""

    traces: list[Path] | None
    heads: Path | None
    calibration_traces: list[Path] | None
    dataset_root: Path
    limit: int
    max_new_tokens: int
    no_live: bool
    no_replay: bool
    model: str
    device: str
    ray: str | None
    max_steps: int | None
    quick: bool
    out: Path
    lambda_fit: str = "measured"
    study: str = "sweep"  #: the study's name: its live runs go to OUT/live-<study>


def sweep_options(args: SweepArgs):
    """(SweepOptions, n_heads) from the command line; ValueError / FileNotFoundError on a bad
    option (one line). Head scores: --calibration, else minivox's shipped ones for minivox
    (:func:`~kvsim.commands._options.calibration_for`), else each trace's own, the head count
    then from the first trace's layout."""
    from kvsim.commands._options import calibration_for, check_positive_ints
    from kvsim.specs import default_trace_dir
    from kvsim.trace.heads import read_heads
    from kvsim.trace.reader import Trace, find_traces

    check_positive_ints(limit=args.limit, max_new_tokens=args.max_new_tokens, max_steps=args.max_steps)
    if args.no_live and args.no_replay:
        raise ValueError("--no-live and --no-replay together leave nothing to run")
    traces = [] if args.no_replay else find_traces(
        args.traces or sorted(default_trace_dir().glob("minivox-*.kvtrace")))
    if not args.no_replay and not traces:
        raise ValueError("no *.kvtrace to replay")
    heads = calibration_for(args.model, args.heads)
    if heads is not None:
        if not heads.exists():
            raise FileNotFoundError(f"{heads}: no such calibration file")
        return _options(args, traces, heads), read_heads(heads).voice_score.size
    if not traces:
        raise ValueError(f"--calibration FILE: live WnW on {args.model} needs its head scores "
                         "(kvsim calibrate)")
    lay = Trace(traces[0]).head_layout
    return _options(args, traces, None), lay.n_layers * lay.n_kv_heads


def _options(args: SweepArgs, traces: list[Path], heads: Path | None):
    from kvsim.studies.live_grid import GridSpec, study_live_folder
    from kvsim.studies.wnw_sweep import SweepOptions
    from kvsim.trace.reader import find_traces

    calib = find_traces(args.calibration_traces) if args.calibration_traces else []
    return SweepOptions(
        traces=traces, heads=heads, calibration_traces=calib,
        live_out=None if args.no_live else study_live_folder(args.out, args.study),
        dataset_root=args.dataset_root,
        limit=min(args.limit, 2) if args.quick else args.limit, max_new_tokens=args.max_new_tokens,
        grid=GridSpec(model=args.model, device=args.device, ray=args.ray), max_steps=args.max_steps,
        lambda_fit=args.lambda_fit)


def run_sweep_study(report_fn, args: SweepArgs, t0: float) -> None:
    """Build a WnW sweep study's report with ``report_fn`` (table3_report, table7_report) from
    the parsed options and write it; a bad input is one line (exit 2)."""
    from kvsim.commands._errors import err, fail
    from kvsim.commands.study import finish
    from kvsim.live.data import DataError
    from kvsim.trace.schema import TraceError

    try:
        opts, n_heads = sweep_options(args)
        report = report_fn(opts, n_heads, quick=args.quick, log=lambda m: err.print(m, markup=False))
    except (ValueError, KeyError, FileNotFoundError, TraceError, DataError) as exc:
        fail(exc)
    finish(report, args.out, t0)


def sweep_command(study: str, summary: str):
    """The ``kvsim study STUDY`` command of a WnW sweep study: the options above, the report
    built by ``kvsim.studies.STUDY.STUDY_report`` and written by :func:`run_sweep_study`;
    ``summary`` is its help text."""

    def command(
        traces: TracesArg = None,
        calibration: HeadsOption = None,
        calibration_traces: CalibTracesOption = None,
        lambda_fit: LambdaFitOption = "measured",
        dataset_root: DatasetRootOption = Path("data/minivox"),
        limit: LimitOption = 8,
        max_new_tokens: MaxNewOption = 300,
        no_live: NoLiveOption = False,
        no_replay: NoReplayOption = False,
        model: ModelOption = "minivox",
        device: DeviceOption = "cpu",
        ray: RayOption = None,
        max_steps: MaxStepsOption = None,
        quick: QuickOption = False,
        out: OutOption = None,
    ) -> None:
        import importlib
        import time

        from kvsim.commands.study import default_out

        t0 = time.perf_counter()
        report_fn = getattr(importlib.import_module(f"kvsim.studies.{study}"), f"{study}_report")
        out = default_out(study, out)
        args = SweepArgs(traces, calibration, calibration_traces, dataset_root, limit, max_new_tokens,
                         no_live, no_replay, model, device, ray, max_steps, quick, out,
                         lambda_fit=lambda_fit, study=study)
        run_sweep_study(report_fn, args, t0)

    command.__name__ = command.__qualname__ = study
    command.__doc__ = f"{summary}\n\n--quick: the first and last setting of each sweep, 2 live clips.\n"
    return command
