"""What every study writes: a markdown table with the paper's numbers side by side, a parquet
of all measured data, an altair figure (HTML that opens offline, and PNG), and how it was made.

A study builds a :class:`StudyReport`; :func:`write_report` writes it under one folder,
every file atomically, the markdown last (a folder with ``<name>.md`` is a complete report).
"""

from __future__ import annotations

import platform
import shlex
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from kvsim.trace.atomic import atomic_file, atomic_write_text

#: How every study treats the encoder's padding today (:mod:`kvsim.replay.padding`), stated in
#: its report: the traces are replayed as recorded and live runs decode the model's own prompt.
PADDING_COUNTED = (
    "Encoder padding: counted as audio. Replay reads the traces as recorded (`kvsim replay "
    "--padding count`): the tokens a Whisper-style encoder makes from the zeros that fill its "
    "last 30 s window are in T_a, the budgets and r_GPU; live runs decode the prompt the "
    "processor makes, padding included (`kvsim live --transform none`; `nopad` takes it out).")


@dataclass
class StudyReport:
    """One study's result.

    Parameters
    ----------
    name
        File stem of every output (``fig1``, ``table3``, ...).
    title
        Heading of the markdown report.
    tables
        ``(caption, frame)`` pairs written as markdown tables in order; the paper's figures sit
        in columns of these frames beside kvsim's (column names say which is which).
    data
        Everything measured, one row per measurement (written as ``<name>.parquet``).
    chart
        An altair chart (``<name>.html`` / ``<name>.png``), or None.
    notes
        Paragraphs after the tables: what was run, on what, and how to read the tables.
    padding
        The sentence saying whether the encoder's padding was counted as audio (printed after
        the notes); None for a study without audio positions.
    """

    name: str
    title: str
    tables: list[tuple[str, pl.DataFrame]]
    data: pl.DataFrame
    chart: Any = None
    notes: list[str] = field(default_factory=list)
    extra_data: dict[str, pl.DataFrame] = field(default_factory=dict)
    padding: str | None = PADDING_COUNTED


def markdown_table(frame: pl.DataFrame, digits: int = 3) -> list[str]:
    """A frame as a GitHub markdown table; floats to ``digits`` places, None/NaN as ``–``."""
    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and v != v):
            return "–"
        if isinstance(v, float):
            return f"{v:.{digits}f}"
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(frame.columns) + " |",
             "|" + "|".join("---" for _ in frame.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.iter_rows()]
    return lines


def write_report(report: StudyReport, out: Path, wall_s: float, argv: list[str] | None = None) -> list[Path]:
    """Write ``report`` under ``out``; returns the paths written (markdown last).

    The markdown ends with the command line, the wall time and the machine, so a committed
    report says how to make it again.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with atomic_file(out / f"{report.name}.parquet") as tmp:
        report.data.write_parquet(tmp)
    written.append(out / f"{report.name}.parquet")
    for suffix, frame in report.extra_data.items():
        with atomic_file(out / f"{report.name}_{suffix}.parquet") as tmp:
            frame.write_parquet(tmp)
        written.append(out / f"{report.name}_{suffix}.parquet")
    if report.chart is not None:
        from kvsim.plots import save_chart

        written += save_chart(report.chart, out / report.name)
    md = out / f"{report.name}.md"
    atomic_write_text(md, render_markdown(report, wall_s, argv))
    return [*written, md]


def render_markdown(report: StudyReport, wall_s: float, argv: list[str] | None = None) -> str:
    """The report as markdown: title, tables, figure, notes, provenance."""
    lines = [f"# {report.title}", ""]
    for caption, frame in report.tables:
        lines += [caption, "", *markdown_table(frame), ""]
    if report.chart is not None:
        lines += [f"![{report.title}]({report.name}.png)", ""]
    for note in report.notes:
        lines += [note, ""]
    if report.padding:
        lines += [report.padding, ""]
    cmd = shlex.join(["kvsim", *(argv if argv is not None else sys.argv[1:])])
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines += ["Made by:", "", "```bash", cmd, "```", "",
              f"Wall time {wall_s:.0f} s on {_machine()}, {when}. All data: "
              f"`{report.name}.parquet`.", ""]
    return "\n".join(lines)


def _machine() -> str:
    import os

    return f"{os.cpu_count()} CPU cores ({platform.machine()}, {platform.processor() or 'cpu'})"
