"""``kvsim study fig1``: WnW §2.1 / Fig. 1 (prefill vs decode attention over the audio)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kvsim.commands.study import OutOption, QuickOption, default_out, finish


def fig1(
    traces: Annotated[list[Path] | None, typer.Argument(help="Traces or folders of traces (default: the shipped traces/)")] = None,
    quick: QuickOption = False,
    out: OutOption = None,
) -> None:
    """Cumulative attention mass over normalised audio position, prefill vs decode-cumulative, and the per-KV-head top-100 Jaccard distribution, on every trace given, beside the WnW paper's §2.1 figures (--quick: the first trace only)."""
    from kvsim.commands._errors import fail
    from kvsim.commands.study._traces import open_traces
    from kvsim.specs import default_trace_dir
    from kvsim.studies.fig1 import fig1_report
    from kvsim.trace.schema import TraceError

    t0 = time.perf_counter()
    out = default_out("fig1", out)
    try:
        default = [default_trace_dir()] if not traces else []
    except FileNotFoundError as exc:
        fail(exc)
    opened = open_traces(traces, default)
    try:
        report = fig1_report(opened[:1] if quick else opened)
    except (TraceError, ValueError) as exc:
        fail(exc)
    finish(report, out, t0)


COMMAND = fig1
