"""Writing replay outputs: the results table and the per-step logs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from kvsim.replay.engine import RunResult
from kvsim.trace.atomic import atomic_file, atomic_write_text


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


def markdown_table(frame: pl.DataFrame, columns: Sequence[tuple[str, str, str]]) -> str:
    """``frame`` as a GitHub markdown table in (column, header, format) triples (for the
    results pages); columns the frame lacks are skipped."""
    from kvsim.commands._table import Column, markdown_lines

    cols = [Column(key, header, fmt, text=fmt == "{}") for key, header, fmt in columns
            if key in frame.columns]
    return "\n".join(markdown_lines(frame, cols))
