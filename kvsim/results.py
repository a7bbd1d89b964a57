"""Writing replay outputs: the results table, per-step logs, and the on-screen table."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import polars as pl
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvsim.replay.engine import RunResult
from kvsim.trace.atomic import atomic_file, atomic_write_text

#: Columns shown on screen, with their headers and formats.
SCREEN_COLUMNS = [
    ("trace", "trace", "{}"),
    ("label", "policy", "{}"),
    ("budget", "target r", "{:.2f}"),
    ("r_gpu", "r_GPU", "{:.3f}"),
    ("r_gpu_cpu", "r_GPU+CPU", "{:.3f}"),
    ("attn_recall", "attn recall", "{:.4f}"),
    ("output_error", "out err", "{:.4f}"),
    ("topk_jaccard", "top-K J", "{:.3f}"),
    ("h2d_mb_per_step", "H2D MB/step", "{:.3f}"),
    ("transfers_per_step", "copies/step", "{:.1f}"),
]


def step_log_name(result: RunResult) -> str:
    safe = result.spec.label.replace("/", "_").replace(" ", "")
    return f"{result.trace}__{safe}__{result.spec.budget:g}"


def results_frame(results: Sequence[RunResult]) -> pl.DataFrame:
    return pl.DataFrame([r.summary for r in results])


def write_step_logs(out: Path, results: Sequence[RunResult]) -> list[str]:
    """Write ``steps/<trace>__<policy>__<budget>.{parquet,json}`` atomically (each file
    appears whole or not at all); returns their names relative to ``out``."""
    steps = out / "steps"
    steps.mkdir(parents=True, exist_ok=True)
    names = []
    for r in results:
        name = step_log_name(r)
        with atomic_file(steps / f"{name}.parquet") as tmp:
            r.step_log.write_parquet(tmp)
        atomic_write_text(steps / f"{name}.json", json.dumps(r.facts.to_json(), indent=1))
        names.append(f"steps/{name}.parquet")
    return names


def write_outputs(out: Path, results: Sequence[RunResult]) -> pl.DataFrame:
    """Write ``results.parquet`` and the step logs (:func:`write_step_logs`) atomically.
    Returns the results table."""
    out.mkdir(parents=True, exist_ok=True)
    write_step_logs(out, results)
    frame = results_frame(results)
    with atomic_file(out / "results.parquet") as tmp:
        frame.write_parquet(tmp)
    return frame


def print_table(frame: pl.DataFrame, console: Console | None = None, title: str = "kvsim replay",
                columns: Sequence[tuple[str, str, str]] = SCREEN_COLUMNS,
                left: Sequence[str] = ("trace", "label", "transform")) -> None:
    """A rich table of ``frame``: (column, header, format) triples; missing columns skipped."""
    console = console or Console()
    table = Table(title=title, header_style="bold")
    cols = [c for c in columns if c[0] in frame.columns]
    for key, header, _ in cols:
        table.add_column(header, justify="left" if key in left else "right")
    for row in frame.iter_rows(named=True):
        cells = []
        for key, _, fmt in cols:
            v = row[key]
            cells.append("-" if v is None or (isinstance(v, float) and v != v) else escape(fmt.format(v)))
        table.add_row(*cells)
    console.print(table)


def markdown_table(frame: pl.DataFrame, columns: Sequence[tuple[str, str, str]] = SCREEN_COLUMNS) -> str:
    """The same table as GitHub markdown (for the README)."""
    cols = [c for c in columns if c[0] in frame.columns]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for row in frame.iter_rows(named=True):
        cells = []
        for key, _, fmt in cols:
            v = row[key]
            cells.append("-" if v is None or (isinstance(v, float) and v != v) else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_sim_table(frame: pl.DataFrame, console: Console | None = None, title: str = "simulated") -> None:
    """On-screen table of simulator summaries (one row per run and mode)."""
    console = console or Console()
    table = Table(title=title, header_style="bold")
    preferred = ("ms_per_token_mean", "ms_per_token_median", "tokens_per_s", "peak_gpu_gib",
                 "h2d_mb_per_step", "h2d_copies_per_step", "transfer_wait_share")
    numeric = [c for c in preferred if c in frame.columns]
    keys = ["trace", "policy", "budget", "sim_mode"]
    for c in keys + numeric:
        table.add_column(c, justify="left" if c in ("trace", "policy", "sim_mode") else "right")
    for row in frame.iter_rows(named=True):
        table.add_row(*[escape(str(row[c])) for c in keys[:2]], f"{row['budget']:.2f}", escape(str(row["sim_mode"])),
                      *[f"{row[c]:.4g}" if row[c] is not None else "-" for c in numeric])
    console.print(table)
