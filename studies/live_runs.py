"""Existing ``kvsim live`` run folders as a study's input: their per-run rows (finished runs'
``runs.parquet``, or the part files of the inputs a run still going has finished) and the
options they were decoded with."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from kvsim.decoding import OPTION_KEYS


class LiveRunsError(ValueError):
    """A run folder cannot be used (one line naming the folder or file and the field)."""


def read_live_runs(folder: Path) -> pl.DataFrame | None:
    """Every completed run of the ``kvsim live`` folder ``folder``, one row per input × method
    (None while no input has finished).

    A finished run is read from ``runs.parquet``; a run still going (or interrupted) from the
    part file of each input its ``run.json`` lists as completed, so a half-written part is
    never read.
    """
    from kvsim.rundir import MANIFEST, read_manifest

    manifest = read_manifest(folder)
    if manifest is None:
        raise LiveRunsError(f"{folder}: not a kvsim run folder (no readable {MANIFEST})")
    if manifest.get("command") != "live":
        raise LiveRunsError(f"{folder / MANIFEST}: field 'command' is {manifest.get('command')!r}, "
                            "not a kvsim live run")
    if manifest.get("status") == "complete" and (folder / "runs.parquet").is_file():
        return pl.read_parquet(folder / "runs.parquet", glob=False)
    completed = manifest.get("completed") or {}
    parts = [folder / e["part"] for e in completed.values() if isinstance(e, dict) and e.get("part")]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise LiveRunsError(f"{missing[0]}: part listed in {folder / MANIFEST} is missing")
    if not parts:
        return None
    return pl.concat([pl.read_parquet(p, glob=False) for p in parts], how="diagonal_relaxed")


def check_options(folder: Path, expected: dict[str, Any]) -> None:
    """Raise :class:`LiveRunsError` when the folder's run was decoded with other options
    (``expected``: field of ``run.json``'s ``config`` -> value)."""
    from kvsim.rundir import MANIFEST, read_manifest

    config = (read_manifest(folder) or {}).get("config") or {}
    for key, want in expected.items():
        # a decoding option is recorded only when on: absent is plain greedy decoding (None)
        if key not in config and key not in OPTION_KEYS:
            continue
        if config.get(key) != want:
            raise LiveRunsError(f"{folder / MANIFEST}: config field {key!r} is {config.get(key)!r}, "
                                f"this study runs with {want!r}")


RUN_KEY = ("input", "transform", "label", "budget")


def combine(folders: Sequence[Path], expected: dict[str, Any]) -> tuple[pl.DataFrame | None, dict[str, str]]:
    """The rows of every folder (checked against ``expected``; None when no folder has a
    finished input yet) and, per input, the folders it came from; a run (input, transform,
    policy label, budget) found in two folders is an error (it would count twice)."""
    frames, source = [], {}
    for folder in folders:
        check_options(folder, expected)
        frame = read_live_runs(folder)
        if frame is not None:
            frames.append(frame.with_columns(pl.lit(str(folder)).alias("run_folder")))
    if not frames:
        return None, source
    runs = pl.concat(frames, how="diagonal_relaxed")
    dup = runs.filter(runs.select(RUN_KEY).is_duplicated())
    if dup.height:
        row = dup.row(0, named=True)
        where = sorted(set(dup.filter(pl.all_horizontal(pl.col(k) == row[k] for k in RUN_KEY))["run_folder"]))
        raise LiveRunsError(f"{', '.join(where)}: run {row['input']} {row['transform']}/{row['label']}"
                            f"@{row['budget']:g} is in more than one folder")
    for r in runs.select("input", "run_folder").unique(maintain_order=True).iter_rows():
        source[r[0]] = ", ".join(filter(None, [source.get(r[0]), r[1]]))
    return runs, source
