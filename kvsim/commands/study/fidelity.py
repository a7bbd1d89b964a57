"""``kvsim study fidelity``: does replay predict live? (computation in
:mod:`kvsim.studies.fidelity`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._options import calibration_for
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


def fidelity(
    inputs: Annotated[list[Path] | None, typer.Argument(help="Audio files or folders (with .txt references) instead of --dataset-root")] = None,
    dataset_root: DatasetRootOption = Path("data/minivox"),
    split: Annotated[str, typer.Option(help="Dataset split")] = "test_30_60",
    limit: Annotated[int, typer.Option(help="Clips (first N of the split), >= 2")] = 8,
    model: ModelOption = "minivox",
    policy: Annotated[list[str] | None, typer.Option("--policy", "-p", help="Policies (default: the twelve the papers compare)")] = None,
    budget: Annotated[str, typer.Option("--budget", "-b", help="Budgets r_GPU, comma-separated")] = "0.2,0.4,0.6,0.8",
    heads: Annotated[Path | None, typer.Option(help="Calibration heads.json for WnW / AudioKV (default with --model minivox: minivox/heads.json)")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per answer, traced and live (with --live-runs: theirs)")] = 300,
    live_runs: Annotated[list[Path] | None, typer.Option("--live-runs", help="Existing `kvsim live` folders to take the live runs from (repeatable)")] = None,
    aligner: Annotated[str, typer.Option(help="Word alignment of the traces (auto, reference, whisper, none)")] = "auto",
    n_boot: Annotated[int, typer.Option(help="Bootstrap resamples of the clips")] = 1000,
    device: DeviceOption = "cpu",
    ray: RayOption = None,
    quick: QuickOption = False,
    out: OutOption = None,
) -> None:
    """Does replay predict live? Rank correlations of replay metrics with live WER, departures from the full cache's tokens, and a held-out predictor.

    --quick: 2 clips, 60 tokens, 200 resamples; when decoding live, 5 policies at budgets 0.2 and 0.6.
    """
    from kvsim.commands._errors import fail
    from kvsim.specs import parse_budgets
    from kvsim.studies.fidelity import DEFAULT_POLICIES, QUICK_POLICIES, analyse, measure
    from kvsim.studies.fidelity_data import Sources, live_runs_max_new_tokens
    from kvsim.studies.fidelity_report import build_report
    from kvsim.trace.schema import TraceError

    t0 = time.perf_counter()
    out = default_out("fidelity", out)
    if quick:
        limit, max_new_tokens, n_boot = min(limit, 2), min(max_new_tokens, 60), min(n_boot, 200)
        if not live_runs:  # decoding live: a few methods only
            policy, budget = policy or list(QUICK_POLICIES), "0.2,0.6"
    try:
        if live_runs:  # trace as long as the live runs decoded, so tokens compare
            max_new_tokens = live_runs_max_new_tokens(live_runs)
        if limit < 2:
            raise ValueError(f"--limit {limit}: the statistics need at least 2 clips")
        heads = calibration_for(model, heads)
        if heads is not None and not heads.exists():
            raise FileNotFoundError(f"--heads {heads}: no such file")
        items = _inputs(inputs, dataset_root, split, limit)
        from kvsim.live.run import make_plan

        plan = make_plan(policy or list(DEFAULT_POLICIES), parse_budgets(budget))
        src = Sources(model=model, max_new_tokens=max_new_tokens, heads=heads, aligner=aligner,
                      device=device, live_runs=list(live_runs or []), ray=ray)
        points = measure(items, plan, src, out)
        report = build_report(points, analyse(points, n_boot), [])
    except (ValueError, KeyError, OSError, TraceError) as exc:
        fail(exc)
    finish(report, out, t0)


def _inputs(inputs: list[Path] | None, root: Path, split: str, limit: int) -> list:
    """Clips from INPUTS, else the first ``limit`` of ``split`` under ``root``."""
    from kvsim.live.data import from_paths, load_dataset

    if inputs:
        from kvsim.commands.trace import expand_inputs

        return from_paths(expand_inputs(inputs))[:limit]
    return load_dataset("manifest", root, split=split, limit=limit)


COMMAND = fidelity
