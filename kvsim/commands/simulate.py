"""``kvsim simulate``: predict ms/token, GPU memory and transfer cost on a GPU preset.

Three inputs: a replay output directory (``<out>/steps/*.parquet`` + ``*.json`` RunFacts), an
analytic policy description (``--policy wnw --tidal-heads 35 --retention 0.2``), or one of the
documented tables (``--table wnw4`` / ``--table capacity``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands._errors import err, fail
from kvsim.commands._table import (
    Column,
    FormatOption,
    TableFormat,
    WideOption,
    auto_columns,
    print_frame,
)
from kvsim.specs import option_items


def _step_logs(path: Path) -> list[tuple[str, Path, Path]]:
    """(name, parquet, json) for every step log under a replay output directory; when it
    holds a run manifest (``run.json``), only the step logs of that run."""
    from kvsim.rundir import MANIFEST, run_step_logs

    if path.is_file():
        files = [path]
    else:
        listed = run_step_logs(path)
        if listed is not None:
            files = [path / name for name in listed]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{missing[0]}: step log listed in {path / MANIFEST} is missing")
        else:
            d = path / "steps" if (path / "steps").is_dir() else path
            files = sorted(d.glob("*.parquet"))
    out = []
    for pq in files:
        js = pq.with_suffix(".json")
        if not js.exists():
            raise FileNotFoundError(f"{js}: RunFacts JSON missing next to {pq.name}")
        out.append((pq.stem, pq, js))
    if not out:
        raise FileNotFoundError(f"{path}: no step logs (*.parquet with a .json RunFacts)")
    return out


def _load_facts(js: Path):
    """The RunFacts beside a step log; a damaged file is a WorkloadError naming it and the field."""
    from kvsim.sim import WorkloadError, facts_from_json

    try:
        return facts_from_json(json.loads(js.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{js}: not a RunFacts JSON ({exc})") from None
    except WorkloadError as exc:
        raise WorkloadError(f"{js}: {exc}") from None


def _load_step_log(pq: Path, facts):
    """The workload of one step-log parquet; a damaged file is a WorkloadError naming it."""
    import polars as pl

    from kvsim.sim import WorkloadError, from_step_log

    try:
        log = pl.read_parquet(pq, glob=False)
    except (pl.exceptions.PolarsError, OSError) as exc:
        message = " ".join(str(exc).split())
        raise WorkloadError(f"{pq}: not a readable parquet step log ({message})") from None
    try:
        return from_step_log(log, facts)
    except WorkloadError as exc:
        raise WorkloadError(f"{pq}: {exc}") from None


#: The simulator summary: the compact set fits 80 columns unless the run names are long
#: (then the table is printed whole, wider than the terminal).
SIM_COLUMNS = [
    Column("name", "name", text=True),
    Column("gpu", "gpu", text=True),
    Column("mode", "mode", text=True),
    Column("batch", "batch", compact=False),
    Column("ms_per_token_median", "ms/tok", "{:.3f}"),
    Column("ms_per_token_mean", "ms/tok mean", "{:.3f}", compact=False),
    Column("tokens_per_s", "tok/s", "{:.1f}", compact=False),
    Column("peak_gpu_gib", "peak GiB", "{:.3f}"),
    Column("h2d_mb_per_step", "MB/step", "{:.3f}"),
    Column("h2d_copies_per_step", "copies", "{:.1f}", compact=False),
    Column("transfer_wait_share", "wait", "{:.3f}", compact=False),
    Column("max_batch", "max batch"),
    Column("tokens_per_s_at_max_batch", "tok/s @max", "{:.1f}"),
]


def simulate(
    runs: Annotated[Path | None, typer.Argument(help="Replay output dir (with steps/), a steps/ dir or one step-log .parquet")] = None,
    gpu: Annotated[list[str], typer.Option("--gpu", "-g", help="GPU presets (a100-80gb, h100-sxm, h200) or .toml paths, comma-separated")] = ["h100-sxm"],  # noqa: B006
    mode: Annotated[list[str], typer.Option("--mode", "-m", help="sync | overlap | coalesced | sync-run | overlap-run (+graphs), comma-separated")] = ["sync"],  # noqa: B006
    runtime: Annotated[str, typer.Option(help="Host runtime preset: hf-sdpa, hf-eager, static-graphs")] = "hf-sdpa",
    model: Annotated[str | None, typer.Option(help="Model preset (analytic mode; overrides RunFacts.model for step logs)")] = None,
    batch: Annotated[int, typer.Option(help="Identical sequences decoded together")] = 1,
    policy: Annotated[str | None, typer.Option(help="Analytic mode: full | snapkv | wnw")] = None,
    retention: Annotated[float, typer.Option(help="Analytic mode: target r_GPU (audio KV fraction on GPU)")] = 0.2,
    tidal_heads: Annotated[int, typer.Option(help="Analytic WnW: tidal heads")] = 85,
    anchor_heads: Annotated[int, typer.Option(help="Analytic WnW: anchor heads")] = 5,
    audio_minutes: Annotated[float, typer.Option(help="Analytic mode: audio length in minutes, at most 240")] = 4.0,
    churn: Annotated[float, typer.Option(help="Analytic WnW: extra re-fetches of released segments per step, at most the audio's 2-s segments (sensitivity; default 0)")] = 0.0,
    decode_steps: Annotated[int | None, typer.Option(help="Analytic mode: decode steps, at most 100000 (default: transcript length of the audio)")] = None,
    capacity: Annotated[bool, typer.Option("--capacity", help="Also report the largest batch that fits and its tokens/s")] = False,
    capacity_gib: Annotated[float | None, typer.Option(help="GPU memory cap for --capacity (default: the GPU preset's)")] = None,
    markdown: Annotated[bool, typer.Option(help="Same as --format markdown.")] = False,
    table: Annotated[str | None, typer.Option(help="Print a documented table: wnw4 | capacity | memory (WnW Fig. 4 analogue; chart with --out)")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write sim_results.parquet and per-step parquet here")] = None,
    wide: WideOption = False,
    fmt: FormatOption = TableFormat.table,
) -> None:
    """Simulate decode steps on a SimPy model of the host, CUDA streams, HBM and PCIe."""
    import polars as pl

    from kvsim.rundir import OutDirError, check_out_dir
    from kvsim.sim import AnalyticError, ModeError, PresetError, SimMode, WorkloadError

    if markdown:
        fmt = TableFormat.markdown
    try:
        if out is not None:
            check_out_dir(out)
        _check_options(batch=batch, retention=retention, tidal_heads=tidal_heads,
                       anchor_heads=anchor_heads, audio_minutes=audio_minutes, churn=churn,
                       decode_steps=decode_steps, capacity_gib=capacity_gib)
        gpus = option_items(gpu, "--gpu", "gpu")
        if table:
            _documented_table(table, gpus[0], runtime, model, audio_minutes, out, fmt)
            return
        modes = option_items(mode, "--mode", "mode")
        for m in modes:
            SimMode.parse(m)
        if runs is not None and policy:
            raise ValueError("give either a replay directory or --policy, not both")
        if runs is not None:
            jobs = _step_log_jobs(runs, model)
        elif policy:
            jobs = [_analytic_job(model, policy, retention, tidal_heads, anchor_heads, churn,
                                  audio_minutes, decode_steps)]
        else:
            raise ValueError("nothing to simulate: give a replay directory, --policy, or --table")
        rows, frames = _simulate_jobs(jobs, gpus, modes, runtime, batch, capacity, capacity_gib)
    except (PresetError, WorkloadError, ModeError, AnalyticError, OutDirError, ValueError,
            FileNotFoundError) as exc:
        fail(exc)
    print_frame(pl.DataFrame(rows), SIM_COLUMNS, fmt=fmt, wide=wide, title=f"kvsim simulate ({runtime})")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        pl.DataFrame(rows).write_parquet(out / "sim_results.parquet")
        (out / "sim_steps").mkdir(exist_ok=True)
        for name, frame in frames:
            frame.write_parquet(out / "sim_steps" / f"{name}.parquet")
        err.print(f"wrote {out}/sim_results.parquet and {len(frames)} per-step logs", markup=False)


def _documented_table(table: str, gpu: str, runtime: str, model: str | None, audio_minutes: float,
                      out: Path | None, fmt: TableFormat) -> None:
    """Print (and with ``out`` write) one of the documented tables: wnw4, capacity, memory."""
    import polars as pl

    from kvsim.sim import tables

    if table == "wnw4":
        frame = tables.wnw_table4(gpu=gpu, runtime=runtime)
    elif table == "capacity":
        frame = tables.capacity_table()
    elif table == "memory":
        name = model or "voxtral-mini-3b"
        frame = tables.memory_over_steps(name, gpu, audio_minutes * 60)
        if out:
            from kvsim.plots import save_chart

            chart = tables.memory_chart(frame, f"GPU KV cache over decode steps ({name}, {audio_minutes:g} min audio)")
            for p in save_chart(chart, out / "memory_over_steps"):
                err.print(f"wrote {p}", markup=False)
        frame = frame.group_by("policy", "r_gpu").agg(
            pl.col("gib").first().alias("gib_first_step"), pl.col("gib").max().alias("gib_peak"),
            pl.col("gib").last().alias("gib_last_step")).sort("policy", "r_gpu")
    else:
        raise ValueError(f"unknown table {table!r}; use wnw4, capacity or memory")
    print_frame(frame, auto_columns(frame), fmt=fmt, title=f"kvsim simulate --table {table}")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        frame.write_parquet(out / f"table_{table}.parquet")


def _step_log_jobs(runs: Path, model: str | None) -> list[tuple]:
    """(name, workload, model preset) of every step log of a replay output."""
    from kvsim.sim import PresetError, model_preset

    jobs = []
    for name, pq, js in _step_logs(runs):
        facts = _load_facts(js)
        try:
            mp = model_preset(model or facts.model)
        except PresetError as exc:
            raise PresetError(f"{js}: {exc} (or pass --model)") from None
        jobs.append((name, _load_step_log(pq, facts), mp))
    return jobs


def _analytic_job(model: str | None, policy: str, retention: float, tidal_heads: int,
                  anchor_heads: int, churn: float, audio_minutes: float,
                  decode_steps: int | None) -> tuple:
    """(name, workload, model preset) of an analytic policy description."""
    from kvsim.sim import AnalyticPolicy, analytic_workload, model_preset

    if not model:
        raise ValueError("analytic mode needs --model (e.g. voxtral-mini-3b)")
    mp = model_preset(model)
    pol = AnalyticPolicy(policy, retention if policy != "full" else 1.0,
                         tidal_heads=tidal_heads if policy == "wnw" else 0,
                         anchor_heads=anchor_heads, churn_segments_per_step=churn)
    wl = analytic_workload(mp, pol, audio_minutes * 60, decode_steps)
    return f"{mp.name}__{policy}__{pol.r_gpu:g}", wl, mp


def _simulate_jobs(jobs: list[tuple], gpus: list[str], modes: list[str], runtime: str, batch: int,
                   capacity: bool, capacity_gib: float | None) -> tuple[list[dict], list[tuple]]:
    """One summary row and one per-step frame per (job, GPU, mode); ``capacity`` adds the
    largest batch that fits in ``capacity_gib`` (None: the GPU preset's memory)."""
    from kvsim.sim import max_batch, simulate_workload

    rows, frames = [], []
    for name, wl, mp in jobs:
        for g in gpus:
            for m in modes:
                res = simulate_workload(wl, g, m, model=mp, runtime=runtime, batch=batch)
                row = {"name": name, **res.summary(), "mode": m}
                if capacity:
                    b = max_batch(wl, g, m, model=mp, runtime=runtime, capacity_gib=capacity_gib)
                    row["max_batch"] = b
                    row["tokens_per_s_at_max_batch"] = (simulate_workload(
                        wl, g, m, model=mp, runtime=runtime, batch=b).summary()["tokens_per_s"]
                        if b else 0.0)
                rows.append(row)
                frames.append((f"{name}__{res.gpu}__{m}", res.per_step))
    return rows, frames


def _check_options(batch: int, retention: float, tidal_heads: int, anchor_heads: int,
                   audio_minutes: float, churn: float, decode_steps: int | None,
                   capacity_gib: float | None) -> None:
    """Range of every numeric option (OptionError, a ValueError, names the option)."""
    from kvsim.commands._options import check_positive_ints, check_range
    from kvsim.sim.analytic import MAX_AUDIO_MINUTES, MAX_DECODE_STEPS

    check_positive_ints(batch=batch)
    check_range("--decode-steps", decode_steps, 1, MAX_DECODE_STEPS)
    check_range("--retention", retention, 0, 1, low_open=True)
    check_range("--tidal-heads", tidal_heads, 0)
    check_range("--anchor-heads", anchor_heads, 0)
    check_range("--audio-minutes", audio_minutes, 0, MAX_AUDIO_MINUTES, low_open=True)
    check_range("--churn", churn, 0)
    check_range("--capacity-gib", capacity_gib, 0, low_open=True)


COMMANDS = (simulate,)
