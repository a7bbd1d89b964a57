"""``kvsim replay``: replay policies over traces and report what they keep."""

from __future__ import annotations

import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from kvsim.specs import default_trace_dir, parse_budgets, parse_policies

console = Console(stderr=True, soft_wrap=True)


def _replay_one(path: str, specs: list, cfg: object) -> tuple[list, list[str]]:
    """Replay one trace; errors come back as one-line messages (runs in worker processes)."""
    from kvsim.replay.engine import Replayer
    from kvsim.trace.reader import Trace
    from kvsim.trace.schema import TraceError

    try:
        rep = Replayer(Trace(path), cfg)
        results = rep.run(specs)
    except TraceError as exc:
        return [], [str(exc)]
    except ValueError as exc:
        return [], [f"{path}: {exc}"]
    return results, [f"{path}: {s.label}@{s.budget:g}: {msg}" for s, msg in rep.failures]


def replay(
    traces: Annotated[list[Path] | None, typer.Argument(help="Trace directories or folders of *.kvtrace (default: the shipped traces/)")] = None,
    policy: Annotated[list[str], typer.Option("--policy", "-p", help="Policy names, comma-separated or repeated; 'all' for every policy; hyperparameters as name:key=value:key=value")] = ["full,streaming,snapkv"],  # noqa: B006
    budget: Annotated[str, typer.Option("--budget", "-b", help="Target r_GPU values, comma-separated")] = "0.2",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory")] = Path("runs/replay"),
    calibration: Annotated[Path | None, typer.Option(help="heads.json calibration file (WnW, AudioKV)")] = None,
    plot: Annotated[bool, typer.Option("--plot", help="Write recall-vs-r_GPU chart (HTML + PNG)")] = False,
    simulate: Annotated[str | None, typer.Option("--simulate", help="GPU preset (a100-80gb, h100-sxm, h200): also predict ms/token, memory and transfer wait of every run with the SimPy model")] = None,
    sim_mode: Annotated[str, typer.Option(help="Simulator recall modes with --simulate, comma-separated (sync, overlap, coalesced, ...)")] = "sync,overlap",
    topk: Annotated[int, typer.Option(help="K of the top-K Jaccard metric")] = 100,
    error_stride: Annotated[int, typer.Option(help="Output error sampled every N steps (needs values; 1 = every step)")] = 16,
    max_steps: Annotated[int | None, typer.Option(help="Replay only the first N decode steps")] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Traces replayed in parallel (processes)")] = 1,
    ray: Annotated[str | None, typer.Option("--ray", help="Replay traces as Ray tasks on a cluster: its address ('auto' for the one `ray start` made, 'local' for a local Ray)")] = None,
) -> None:
    """Replay KV-cache policies over traces; write results.parquet, per-step logs and a table."""
    from kvsim.replay.engine import ReplayConfig
    from kvsim.results import print_table, write_outputs
    from kvsim.trace.heads import read_heads
    from kvsim.trace.reader import find_traces
    from kvsim.trace.schema import TraceError

    try:
        specs = [s for b in parse_budgets(budget) for s in parse_policies(policy, b)]
        paths = find_traces(traces or [default_trace_dir()])
        scores = read_heads(calibration) if calibration else None
    except (ValueError, KeyError, FileNotFoundError, TraceError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if not paths:
        console.print("[red]error:[/] no *.kvtrace found")
        raise typer.Exit(2)
    cfg = ReplayConfig(topk=topk, error_stride=error_stride, max_steps=max_steps, head_scores=scores)
    t0 = time.perf_counter()
    results, errors = [], []
    if ray:
        for res, errs in _run_on_ray(ray, paths, specs, cfg):
            results += res
            errors += errs
    elif jobs > 1 and len(paths) > 1:
        # spawn, not fork: forking a process that runs polars' thread pool can deadlock
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for res, errs in pool.map(_replay_one, map(str, paths), [specs] * len(paths), [cfg] * len(paths)):
                results += res
                errors += errs
    else:
        for path in paths:
            console.print(f"replaying {escape(str(path))} ({len(specs)} policy/budget runs)")
            res, errs = _replay_one(str(path), specs, cfg)
            results += res
            errors += errs
    for e in errors:
        console.print(f"[red]error:[/] {escape(e)}")
    if not results:
        raise typer.Exit(1)
    frame = write_outputs(out, results)
    print_table(frame, Console())
    if simulate:
        _simulate(results, out, simulate, sim_mode)
    if plot:
        from kvsim.plots import recall_vs_rgpu, save_chart

        for p in save_chart(recall_vs_rgpu(frame), out / "recall_vs_rgpu"):
            console.print(f"wrote {p}")
    console.print(f"{len(results)} runs over {len(paths)} traces in {time.perf_counter() - t0:.1f}s -> {out}/results.parquet")
    if errors:
        sys.exit(1)


def _run_on_ray(address: str, paths: list[Path], specs: list, cfg: object) -> list[tuple[list, list[str]]]:
    """One Ray task per trace on an existing cluster (or a local Ray with 'local')."""
    try:
        import ray
    except ImportError:
        console.print("[red]error:[/] --ray needs Ray: pip install 'kvsim[ray]'")
        raise typer.Exit(2) from None
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False)
    task = ray.remote(_replay_one)
    return ray.get([task.remote(str(p), specs, cfg) for p in paths])


def _simulate(results: list, out: Path, gpu: str, modes: str) -> None:
    """Feed every run's step log to the hardware simulator; write sim_results.parquet."""
    from kvsim.results import print_sim_table
    from kvsim.sim import simulate_runs
    from kvsim.trace.atomic import atomic_file

    try:
        sim = simulate_runs(results, gpu=gpu, modes=tuple(m.strip() for m in modes.split(",") if m.strip()))
    except (KeyError, ValueError) as exc:  # unknown preset or mode: one line, results kept
        console.print(f"[red]error:[/] --simulate: {exc}")
        raise typer.Exit(2) from None
    with atomic_file(out / "sim_results.parquet") as tmp:
        sim.write_parquet(tmp)
    print_sim_table(sim, Console(), title=f"simulated on {gpu}")


def register(app: typer.Typer) -> None:
    app.command()(replay)
