"""The live part of a study: an input × method grid decoded by ``kvsim live``'s engine into a
run folder (the same layout, so ``kvsim simulate`` and a later ``--resume`` read it), or an
earlier such folder reused.

Every study that decodes goes through :func:`live_grid`, so where the grid runs (here, or as
Ray tasks) is decided in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from kvsim.live.decode import LiveConfig
from kvsim.live.run import PlanItem

if TYPE_CHECKING:
    from kvsim.live.run import LiveJob
    from kvsim.rundir import RunDir


def study_live_folder(out: Path, study: str) -> Path:
    """The ``kvsim live`` run folder ``study`` decodes into: ``OUT/live-<study>``.

    One folder per study, so that studies written to the same ``-o`` never clear each other's
    live runs (a fresh grid clears its folder; a rerun with the same options reuses it)."""
    return out / f"live-{study}"


@dataclass
class GridSpec:
    """Where and how to decode a grid.

    ``ray``: None to decode in this process, else a Ray address (``local`` starts a local Ray,
    ``auto`` joins the cluster ``ray start`` made): one task per input, as ``kvsim live --ray``.
    """

    model: str = "minivox"
    device: str = "cpu"
    dtype: str = "float32"
    ray: str | None = None
    resume: bool = True


def live_grid(items: Sequence, plan: Sequence[PlanItem], cfg: LiveConfig, out: Path,
              grid: GridSpec = GridSpec(), log: Callable[[str], None] = print, **job_args) -> pl.DataFrame:
    """Decode every (input, method) of ``plan`` into the run folder ``out``; returns
    ``runs.parquet`` (one row per input × method).

    With ``grid.resume`` (default) a folder that an earlier call with the same options filled
    is reused: completed inputs are not decoded again; a folder of other options is cleared.
    """
    from kvsim.live.run import LiveJob
    from kvsim.rundir import RunDir, read_manifest

    config = {"model": grid.model, "plan": [f"{p.transform}/{p.spec.label}@{p.spec.budget:g}" for p in plan],
              "max_new_tokens": cfg.max_new_tokens, "physical": cfg.physical, "dtype": grid.dtype,
              **cfg.decoding_options(),
              **{k: v for k, v in job_args.items() if isinstance(v, (str, int, float, type(None)))}}
    old = read_manifest(Path(out))
    same = old is not None and old.get("command") == "live" and old.get("config") == config
    run = RunDir.open(out, "live", [i.id for i in items], config, resume=grid.resume and same)
    with run:
        job = LiveJob(items, plan, cfg, **job_args)
        if set(run.completed) >= {i.id for i in items}:
            frame = run.parts()
        else:
            frame = _decode(grid, job, run, log)
        run.finish()
    return frame


def _decode(grid: GridSpec, job: LiveJob, run: RunDir, log: Callable[[str], None]) -> pl.DataFrame:
    """The inputs of ``job`` that ``run`` lacks, decoded here or as Ray tasks."""
    if grid.ray:
        from kvsim.live.remote import ModelSpec, check_model, run_live_on_ray

        check_model(grid.model)
        return run_live_on_ray(grid.ray, ModelSpec(grid.model, grid.device, grid.dtype), job, run, log)
    from kvsim.live.models import load_backbone
    from kvsim.live.run import run_live

    lm = load_backbone(grid.model, device=grid.device, dtype=grid.dtype)
    return run_live(lm, job, run, log=log)
