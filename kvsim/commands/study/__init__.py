"""``kvsim study NAME``: the papers' studies as commands (one module per study here, its
computation in :mod:`kvsim.studies`). A module registers its function in ``COMMAND``."""

from __future__ import annotations

import importlib
import pkgutil
import time
from pathlib import Path
from typing import Annotated

import typer

study_app = typer.Typer(
    name="study",
    help="The papers' studies: each writes a markdown table beside the paper's numbers, a parquet and a figure.",
    no_args_is_help=True,
)

#: Options every study takes.
QuickOption = Annotated[bool, typer.Option("--quick", help="A small run (fewer inputs, budgets, settings) to try the study")]


OutOption = Annotated[Path | None, typer.Option("--out", "-o", help="Output folder (default runs/study/<study>)")]

#: Options every study that decodes live takes.
DatasetRootOption = Annotated[Path, typer.Option("--dataset-root", help="minivox corpus folder (its manifest.parquet) of the live inputs")]
ModelOption = Annotated[str, typer.Option("--model", "-m", help="Backbone the study runs (minivox; tiny = the random test backbone)")]
DeviceOption = Annotated[str, typer.Option("--device", help="Live device (cpu, cuda)")]
RayOption = Annotated[str | None, typer.Option("--ray", help="Fit λ and decode the live grid as Ray tasks on this cluster ('local' for a local Ray)")]
LambdaFitOption = Annotated[str, typer.Option("--lambda-fit", help="How WnW's λ is fitted on the calibration traces: measured (decode-time r_GPU with recalls, WnW §3.4) or prefill (prefill r_GPU only)")]


def default_out(name: str, out: Path | None) -> Path:
    """``out``, or ``runs/study/<name>`` when none was given; checked before any work (an
    existing file, a file in its path or an unwritable folder: one line, exit 2)."""
    from kvsim.commands._errors import fail
    from kvsim.rundir import OutDirError, check_out_dir

    folder = out if out is not None else Path("runs/study") / name
    try:
        check_out_dir(folder)
    except OutDirError as exc:
        fail(exc)
    return folder


def finish(report, out: Path, t0: float) -> None:
    """Write a study's report under ``out`` and say where (one line per file on stderr)."""
    from kvsim.commands._errors import err
    from kvsim.studies.report import write_report

    for path in write_report(report, out, time.perf_counter() - t0):
        err.print(f"wrote {path}", markup=False)


def _register() -> None:
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        command = module.COMMAND
        study_app.command(name=command.__name__.replace("_", "-"))(command)


_register()

COMMANDS = (study_app,)
