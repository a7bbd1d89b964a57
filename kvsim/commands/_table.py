"""The one table printer of the commands: a compact column set that fits 80 columns by
default with short names, every column with ``--wide``, and ``--format markdown|csv`` for logs and documents.

Names (traces, policies, inputs) are never cut: when a table is wider than the terminal it is
printed at its natural width (the terminal wraps the line) rather than shortened with ``…``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

import polars as pl
import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


class TableFormat(StrEnum):
    """How a command prints its table."""

    table = "table"
    markdown = "markdown"
    csv = "csv"


FormatOption = Annotated[TableFormat, typer.Option(
    "--format", help="table (for a terminal), markdown (for documents) or csv (for logs and scripts; raw values, column names as stored).")]
WideOption = Annotated[bool, typer.Option(
    "--wide", help="Show every column (the default set fits 80 columns with short names; names are never cut).")]


@dataclass(frozen=True)
class Column:
    """One column: the frame's ``key``, the ``header`` shown, the cell format, whether it is
    text (left-aligned) and whether the compact default set shows it."""

    key: str
    header: str
    fmt: str = "{}"
    text: bool = False
    compact: bool = True


def shown_columns(available: Sequence[str], columns: Sequence[Column], wide: bool) -> list[Column]:
    """The columns to print: those the frame has, all of them with ``wide``, else the compact set."""
    return [c for c in columns if c.key in available and (wide or c.compact)]


#: Cell format: 4 significant digits, whole numbers with thousands separators from 10^4 on.
SIGNIFICANT = "significant"


def auto_columns(frame: pl.DataFrame) -> list[Column]:
    """Every column of ``frame`` under its own name: text left-aligned, floats to 4
    significant digits, all in the compact set (for tables whose every column matters)."""
    def fmt(dtype: pl.DataType) -> str:
        return SIGNIFICANT if dtype.is_float() else "{}"

    return [Column(name, name, fmt(dtype), text=dtype == pl.String)
            for name, dtype in frame.schema.items()]


def format_cell(value: object, fmt: str) -> str:
    """``value`` through ``fmt``; ``-`` for a missing value (None or NaN)."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if fmt == SIGNIFICANT:
        return (f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}") if isinstance(value, float) else str(value)
    return fmt.format(value)


def markdown_lines(frame: pl.DataFrame, columns: Sequence[Column]) -> list[str]:
    """A GitHub markdown table of ``frame`` in the given columns (all of them)."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |",
             "|" + "|".join("---" if c.text else "--:" for c in columns) + "|"]
    for row in frame.iter_rows(named=True):
        cells = (format_cell(row[c.key], c.fmt).replace("|", "\\|") for c in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def print_frame(frame: pl.DataFrame, columns: Sequence[Column], *, fmt: TableFormat = TableFormat.table,
                wide: bool = False, title: str | None = None, console: Console | None = None) -> None:
    """Print ``frame`` on stdout in ``fmt`` with the columns :func:`shown_columns` picks."""
    cols = shown_columns(frame.columns, columns, wide)
    if fmt == TableFormat.csv:
        sys.stdout.write(frame.select([c.key for c in cols]).write_csv())
        return
    if fmt == TableFormat.markdown:
        sys.stdout.write("\n".join(markdown_lines(frame, cols)) + "\n")
        return
    table = new_table(title)
    for c in cols:
        table.add_column(Text(c.header), justify="left" if c.text else "right", no_wrap=True)
    for row in frame.iter_rows(named=True):  # Text cells: user names are never read as markup
        table.add_row(*(Text(format_cell(row[c.key], c.fmt)) for c in cols))
    print_whole(table, console)


def new_table(title: str | None = None) -> Table:
    """The commands' table style: a header rule, no vertical lines (fits more in 80 columns)."""
    return Table(title=Text(title) if title else None, header_style="bold", box=box.SIMPLE_HEAD,
                 pad_edge=False, show_edge=False)


def print_whole(renderable: Table, console: Console | None = None) -> None:
    """Print a table at the terminal's width, or at its own natural width when wider, so
    that no cell is cut (rich would shorten cells with ``…`` to fit)."""
    console = console or Console(emoji=False, highlight=False)
    needed = console.measure(renderable, options=console.options.update_width(10_000)).maximum
    width = console.width
    console.width = max(width, needed)  # print() clamps its width= to the console's
    try:
        console.print(renderable, markup=False)
    finally:
        console.width = width
