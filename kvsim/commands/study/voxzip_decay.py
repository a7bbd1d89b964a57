"""``kvsim study voxzip-decay``: VoxZip's temporal-decay γ sweep (its Table 5), replay and live."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands.study import (
    DatasetRootOption,
    DeviceOption,
    ModelOption,
    OutOption,
    QuickOption,
    RayOption,
    default_out,
    finish,
)


def voxzip_decay(
    traces: Annotated[list[Path] | None, typer.Argument(help="Traces or folders of traces for the replay part (default: the shipped traces/minivox-*.kvtrace)")] = None,
    gamma: Annotated[str | None, typer.Option("--gamma", help="γ values in (0, 1], comma-separated (default: the paper's 0.9,0.95,0.99,1.0; --quick 0.95,1.0)")] = None,
    budget: Annotated[str, typer.Option("--budget", "-b", help="Budgets r, comma-separated (the paper's 0.05, and 0.2)")] = "0.05,0.2",
    live: Annotated[bool, typer.Option("--live/--no-live", help="Also decode minivox clips live (WER, termination)")] = True,
    dataset_root: DatasetRootOption = Path("data/minivox"),
    split: Annotated[str, typer.Option(help="Manifest split decoded live")] = "test_30_60",
    limit: Annotated[int, typer.Option(help="Clips decoded live (>= 1; --quick 2)")] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Live generation stops after this many tokens (>= 1)")] = 300,
    model: ModelOption = "minivox",
    device: DeviceOption = "cpu",
    ray: RayOption = None,
    live_out: Annotated[Path | None, typer.Option(help="The live part's `kvsim live` run folder (default OUT/live-voxzip-decay; reused when the options match)")] = None,
    quick: QuickOption = False,
    out: OutOption = None,
) -> None:
    """VoxZip Table 5 analogue: kvsim's voxzip policy at every γ × budget, replayed on traces (attention recall, output error, top-K Jaccard) and decoded live on minivox clips (truncated WER, termination), beside the paper's quoted accuracies (a different task: for direction only).

    --quick: 2 γ values (0.95, 1.0), the first trace, and live 2 clips at the first budget only (the paper's 5% by default).
    """
    from kvsim.commands._errors import fail
    from kvsim.commands._options import check_positive_ints
    from kvsim.commands.study._traces import open_traces
    from kvsim.live.data import DataError, load_dataset
    from kvsim.studies.live_grid import study_live_folder
    from kvsim.studies.voxzip_decay import LiveSweep, decay_report, replay_sweep
    from kvsim.trace.schema import TraceError

    t0 = time.perf_counter()
    out = default_out("voxzip-decay", out)
    try:
        check_positive_ints(limit=limit, max_new_tokens=max_new_tokens)
        gammas, budgets = _grid(gamma, budget, quick)
        items = load_dataset("manifest", dataset_root, split=split, limit=2 if quick else limit) if live else []
        default = [] if traces else _default_traces()
    except (ValueError, DataError, FileNotFoundError) as exc:
        fail(exc)
    opened = open_traces(traces, default)
    opened = opened[:1] if quick else opened
    try:
        replay, _ = replay_sweep(opened, gammas, budgets)
    except (TraceError, ValueError) as exc:
        fail(exc)
    sweep = LiveSweep(items, live_out or study_live_folder(out, "voxzip-decay"), max_new_tokens,
                      model, device, ray)
    runs = _live(sweep, gammas, budgets[:1] if quick else budgets) if live else None
    windows = {t.name: len(t.window_positions) for t in opened}
    finish(decay_report(replay, runs, windows), out, t0)


def _grid(gamma: str | None, budget: str, quick: bool) -> tuple[list[float], list[float]]:
    """γ values and budgets from the options, checked (ValueError naming the bad one)."""
    from kvsim.specs import parse_budgets
    from kvsim.studies.voxzip_decay import PAPER_GAMMAS, QUICK_GAMMAS, decay_specs

    gammas = _gammas(gamma) if gamma is not None else list(QUICK_GAMMAS if quick else PAPER_GAMMAS)
    budgets = parse_budgets(budget)
    decay_specs(gammas, budgets)  # a γ out of range fails here, before any work
    return gammas, budgets


def _live(sweep, gammas: list[float], budgets: list[float]):
    """The live part; a failure that leaves no completed run is one line (exit 1)."""
    from kvsim.commands._errors import err, fail
    from kvsim.live.data import DataError
    from kvsim.studies.voxzip_decay import live_sweep

    try:
        return live_sweep(sweep, gammas, budgets, log=lambda line: err.print(line, markup=False))
    except (ValueError, DataError, FileNotFoundError) as exc:
        fail(exc, code=1)


def _gammas(text: str) -> list[float]:
    """``"0.9,0.95"`` -> floats (range checked by the policy)."""
    from kvsim.specs import option_items

    items = option_items(text, "--gamma", "gamma")
    try:
        return [float(x) for x in items]
    except ValueError:
        raise ValueError(f"--gamma {text!r}: comma-separated numbers in (0, 1]") from None


def _default_traces() -> list[Path]:
    """The shipped minivox traces."""
    from kvsim.specs import default_trace_dir

    found = sorted(default_trace_dir().glob("minivox-*.kvtrace"))
    if not found:
        raise FileNotFoundError(f"{default_trace_dir()}: no minivox-*.kvtrace; give traces")
    return found


COMMAND = voxzip_decay
