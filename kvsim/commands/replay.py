"""``kvsim replay``: replay policies over traces and report what they keep."""

from __future__ import annotations

import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._errors import err, fail, print_error
from kvsim.commands._table import Column, FormatOption, TableFormat, WideOption, print_frame
from kvsim.specs import default_trace_dir, option_items, parse_budgets, parse_policies

#: The replay summary: the compact set fits 80 columns with whole trace and policy names.
REPLAY_COLUMNS = [
    Column("trace", "trace", text=True),
    Column("label", "policy", text=True),
    Column("budget", "r", "{:.2f}"),
    Column("padding", "padding", text=True, compact=False),
    Column("n_audio", "T_a", "{:d}", compact=False),
    Column("r_gpu", "r_GPU", "{:.3f}"),
    Column("r_gpu_cpu", "r_GPU+CPU", "{:.3f}", compact=False),
    Column("read_fraction", "read", "{:.3f}", compact=False),
    Column("attn_recall", "recall", "{:.3f}"),
    Column("output_error", "out err", "{:.3f}"),
    Column("topk_jaccard", "top-K J", "{:.3f}", compact=False),
    Column("h2d_mb_per_step", "MB/step", "{:.3f}"),
    Column("transfers_per_step", "copies", "{:.1f}", compact=False),
    Column("policy_seconds", "policy s", "{:.2f}", compact=False),
]
#: The ``--simulate`` summary (one row per run and simulator mode); the compact set fits 80
#: columns with the shipped traces' names.
SIM_COLUMNS = [
    Column("trace", "trace", text=True),
    Column("label", "policy", text=True),
    Column("budget", "r", "{:.2f}"),
    Column("sim_mode", "mode", text=True),
    Column("ms_per_token_median", "ms/tok", "{:.3f}"),
    Column("ms_per_token_mean", "ms/tok mean", "{:.3f}", compact=False),
    Column("tokens_per_s", "tok/s", "{:.1f}", compact=False),
    Column("peak_gpu_gib", "GiB", "{:.3f}"),  # peak GPU memory
    Column("h2d_mb_per_step", "MB/step", "{:.3f}", compact=False),
    Column("h2d_copies_per_step", "copies", "{:.1f}", compact=False),
    Column("transfer_wait_share", "wait", "{:.3f}"),
]


def _replay_one(path: str, specs: list, cfg: object) -> tuple[list, list[str], list[str]]:
    """Replay one trace: (results, errors, skipped), each message one line (runs in worker
    processes), so one bad trace never costs the batch. A policy that refuses this trace by
    its own arithmetic (a budget that holds no page) is *skipped*, not an error; one that
    lacks fitting head scores is an error (the user can give them)."""
    from kvsim.policies.base import MissingCalibrationError
    from kvsim.replay.engine import Replayer
    from kvsim.rundir import input_error
    from kvsim.trace.reader import Trace

    try:
        rep = Replayer(Trace(path), cfg)
        results = rep.run(specs)
    except Exception as exc:  # isolation: report this trace, keep the others
        return [], [input_error(path, exc)], []
    errors, skipped = [], []
    for spec, why in rep.failures:
        line = f"{path}: {spec.label}@{spec.budget:g}: {why}"
        (errors if isinstance(why, MissingCalibrationError) else skipped).append(line)
    return results, errors, skipped


def replay(
    traces: Annotated[list[Path] | None, typer.Argument(help="Trace directories or folders of *.kvtrace (default: the shipped traces/)")] = None,
    policy: Annotated[list[str], typer.Option("--policy", "-p", help="Policy names, comma-separated or repeated; 'all' for every policy; hyperparameters as name:key=value:key=value")] = ["full,streaming,snapkv"],  # noqa: B006
    budget: Annotated[str, typer.Option("--budget", "-b", help="Target r_GPU values in (0, 1], comma-separated")] = "0.2",
    out: Annotated[Path, typer.Option("--out", "-o", help="Output directory (a fresh run replaces the previous run's outputs there)")] = Path("runs/replay"),
    calibration: Annotated[Path | None, typer.Option(help="heads.json calibration file (WnW, AudioKV)")] = None,
    plot: Annotated[bool, typer.Option("--plot", help="Write recall-vs-r_GPU chart (HTML + PNG)")] = False,
    simulate: Annotated[str | None, typer.Option("--simulate", help="GPU preset (a100-80gb, h100-sxm, h200): also predict ms/token, memory and transfer wait of every run with the SimPy model")] = None,
    sim_mode: Annotated[str, typer.Option(help="Simulator recall modes with --simulate, comma-separated (sync, overlap, coalesced, ...)")] = "sync,overlap",
    topk: Annotated[int, typer.Option(help="K of the top-K Jaccard metric (>= 1)")] = 100,
    error_stride: Annotated[int, typer.Option(help="Output error sampled every N >= 1 steps (needs values; 1 = every step)")] = 16,
    max_steps: Annotated[int | None, typer.Option(help="Replay only the first N >= 1 decode steps")] = None,
    padding: Annotated[str, typer.Option(help="count: the encoder's padding (the zero-padded tail of the last 30 s window) is audio, as recorded; drop: replay as if it were not in the cache (budgets, r_GPU, recall and every policy over the real audio only; needs traces that record their padding)")] = "count",
    attention_block_mib: Annotated[float, typer.Option(help="Memory (MiB) for decode steps whose attention is computed ahead in one product per layer (up to 16 steps; faster on short traces); 0 = one step at a time. Values differ only in float32 rounding")] = 64.0,
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Traces replayed in parallel (processes, >= 1)")] = 1,
    ray: Annotated[str | None, typer.Option("--ray", help="Replay traces as Ray tasks on a cluster: its address ('auto' for the one `ray start` made, 'local' for a local Ray)")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the traces an interrupted run with the same options completed in --out; replay only the rest")] = False,
    wide: WideOption = False,
    fmt: FormatOption = TableFormat.table,
) -> None:
    """Replay KV-cache policies over traces; write results.parquet, per-step logs and a table.

    Each trace's results are kept as soon as it finishes (parts/); a trace that fails is reported in one line and the others go on (exit code 1). Files in TRACES that are not traces (a README in traces/*) are reported and skipped.
    """
    from kvsim.commands._options import check_positive_ints
    from kvsim.commands.traces import trace_arguments
    from kvsim.replay.engine import ReplayConfig
    from kvsim.replay.padding import check_padding_mode
    from kvsim.rundir import RunDir
    from kvsim.trace.heads import read_heads
    from kvsim.trace.reader import find_traces
    from kvsim.trace.schema import TraceError

    try:
        check_positive_ints(topk=topk, error_stride=error_stride, max_steps=max_steps, jobs=jobs)
        check_padding_mode(padding)
        specs = [s for b in parse_budgets(budget) for s in parse_policies(policy, b)]
        if simulate:
            _check_simulate(simulate, sim_mode, resume)
        given = trace_arguments(traces) if traces else [default_trace_dir()]
        paths = find_traces(given)
        if not paths:
            raise ValueError(f"{', '.join(map(str, given))}: no *.kvtrace found")
        if simulate:
            _check_sim_models(paths)
        scores = read_heads(calibration) if calibration else None
        cfg = ReplayConfig(topk=topk, error_stride=error_stride, max_steps=max_steps,
                           head_scores=scores, padding=padding,
                           attention_block_mib=attention_block_mib)  # validates its fields
        config = {"policies": [s.label for s in specs], "budgets": [s.budget for s in specs],
                  "topk": topk, "error_stride": error_stride, "max_steps": max_steps,
                  "calibration": str(calibration) if calibration else None, "padding": padding,
                  "attention_block_mib": attention_block_mib}
        run = RunDir.open(out, "replay", [str(p) for p in paths], config, resume=resume)
    except (ValueError, KeyError, FileNotFoundError, TraceError) as exc:
        fail(exc)
    with run:
        status = _replay_into(run, [p for p in paths if str(p) not in run.completed], specs, cfg,
                              jobs, ray, (simulate, sim_mode, plot), (fmt, wide))
    if status != "complete":
        sys.exit(1)


def _outcomes(todo: list[Path], specs: list, cfg: object, jobs: int, ray: str | None):
    """(path, results, errors, skipped) per trace, as each finishes (serial, process pool or
    Ray)."""
    if ray:
        yield from _run_on_ray(ray, todo, specs, cfg)
    elif jobs > 1 and len(todo) > 1:
        # spawn, not fork: forking a process that runs polars' thread pool can deadlock
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_replay_one, str(p), specs, cfg): p for p in todo}
            for fut in as_completed(futures):
                try:
                    res, errs, skips = fut.result()
                except Exception as exc:  # a worker died (killed, out of memory)
                    from kvsim.rundir import input_error

                    res, errs, skips = [], [input_error(futures[fut], exc)], []
                yield futures[fut], res, errs, skips
    else:
        for path in todo:
            err.print(f"replaying {path} ({len(specs)} policy/budget runs)", markup=False)
            yield (path, *_replay_one(str(path), specs, cfg))


def _replay_into(run, todo: list[Path], specs: list, cfg: object, jobs: int, ray: str | None,
                 extras: tuple, shown: tuple[TableFormat, bool]) -> str:
    """Replay ``todo``, keeping each trace's results as it finishes; then the combined table
    (``shown``: format and --wide), the optional simulation and chart, and the closed
    manifest. Returns the run status."""
    from kvsim.results import results_frame, write_step_logs

    t0 = time.perf_counter()
    results, n_errors = [], 0
    for path, res, errs, skips in _outcomes(todo, specs, cfg, jobs, ray):
        for e in errs:
            print_error(e)
        for line in skips:
            err.print(f"skipped: {line}", markup=False)
        n_errors += len(errs)
        if res:
            steps = write_step_logs(run.path, res)
            run.done(str(path), results_frame(res), steps=steps, errors=errs, skipped=skips)
            results += res
        else:
            run.failed(str(path), errs[0] if errs else "no run completed")
    frame = run.parts()
    if frame is None:
        run.finish("failed")
        return "failed"
    fmt, wide = shown
    print_frame(frame.sort("trace", "budget", "label"), REPLAY_COLUMNS, fmt=fmt, wide=wide, title="kvsim replay")
    simulate, sim_mode, plot = extras
    if simulate:
        _extra_step(run, "--simulate", _simulate, results, run.path, simulate, sim_mode, shown)
    if plot:
        _extra_step(run, "--plot", _plot, frame, run.path)
    run.write_combined(frame)  # last: no combined results.parquet while the run goes on
    err.print(f"{frame.height} runs over {len(run.completed)} traces in {time.perf_counter() - t0:.1f}s "
              f"-> {run.path}/results.parquet", markup=False)
    return run.finish("failed" if n_errors else None)


def _extra_step(run, flag: str, step, *args: object) -> None:
    """Run ``--simulate`` or ``--plot`` after the replay; a failure is one line naming
    ``flag``, recorded in run.json (the run then ends ``failed``), and the replay results
    are still combined."""
    from kvsim.rundir import input_error

    try:
        step(*args)
    except Exception as exc:  # any failure of the step: the replay's results stay
        message = input_error(flag, exc)
        print_error(message)
        run.output_failed(flag, message)


def _plot(frame, out: Path) -> None:
    """The recall-vs-r_GPU chart of ``frame`` (HTML and PNG) in ``out``."""
    from kvsim.plots import recall_vs_rgpu, save_chart

    for p in save_chart(recall_vs_rgpu(frame), out / "recall_vs_rgpu"):
        err.print(f"wrote {p}", markup=False)


def _run_on_ray(address: str, paths: list[Path], specs: list, cfg: object):
    """One Ray task per trace on an existing cluster (or a local Ray with 'local'); yields
    (path, results, errors, skipped) as each task finishes."""
    from kvsim.cluster import connect
    from kvsim.rundir import input_error

    try:
        ray = connect(address)
    except ValueError as exc:
        fail(exc)
    task = ray.remote(_replay_one)
    pending = {task.remote(str(p), specs, cfg): p for p in paths}
    while pending:
        [ref], _ = ray.wait(list(pending), num_returns=1)
        path = pending.pop(ref)
        try:
            res, errs, skips = ray.get(ref)
        except Exception as exc:  # the task's worker died
            res, errs, skips = [], [input_error(path, exc)], []
        yield path, res, errs, skips


def _check_simulate(gpu: str, modes: str, resume: bool) -> None:
    """Reject a bad ``--simulate`` / ``--sim-mode`` before any work (ValueError, one line)."""
    from kvsim.sim import SimMode, gpu_preset

    if resume:
        raise ValueError("--resume cannot be combined with --simulate: run `kvsim simulate OUT` afterwards")
    try:
        gpu_preset(gpu)
        for m in option_items(modes, "--sim-mode", "mode"):
            SimMode.parse(m)
    except KeyError as exc:
        raise ValueError(f"--simulate: {exc}") from None


def _check_sim_models(paths: list[Path]) -> None:
    """Refuse ``--simulate`` before any work when a trace's model has no simulator preset
    (or another layout than its preset): one line per such trace (ValueError for the last).
    A trace that does not open is left to the replay, which reports it."""
    from kvsim.sim import PresetError, preset_for
    from kvsim.trace.reader import Trace

    lines = []
    for path in paths:
        try:
            model = Trace(path).meta.model
        except Exception:  # reported in one line when it is replayed
            continue
        try:
            preset_for(model.name, model)
        except PresetError as exc:
            lines.append(f"{path}: --simulate: {exc}; replay it without --simulate")
    for line in lines[:-1]:
        print_error(line)
    if lines:
        raise ValueError(lines[-1])


def _simulate(results: list, out: Path, gpu: str, modes: str, shown: tuple[TableFormat, bool]) -> None:
    """Feed every run's step log to the hardware simulator; write sim_results.parquet and
    print its table (``shown``: format and --wide). Preset and modes were checked up front."""
    import polars as pl

    from kvsim.sim import simulate_runs
    from kvsim.trace.atomic import atomic_file

    sim = simulate_runs(results, gpu=gpu, modes=tuple(option_items(modes, "--sim-mode", "mode")))
    with atomic_file(out / "sim_results.parquet") as tmp:
        sim.write_parquet(tmp)
    if "label" not in sim.columns:
        sim = sim.with_columns(pl.col("policy").alias("label"))
    if shown[0] != TableFormat.table:
        sys.stdout.write("\n")  # markdown/csv: the second table starts after an empty line
    print_frame(sim, SIM_COLUMNS, fmt=shown[0], wide=shown[1], title=f"simulated on {gpu}")


COMMANDS = (replay,)
