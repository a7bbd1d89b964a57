"""Run live decoding over inputs x transforms x policies x budgets and write the results."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from kvsim.replay.engine import PolicySpec
from kvsim.trace.atomic import atomic_file, atomic_write_text
from policies.base import MissingCalibrationError
from tracer.live.data import LiveInput
from tracer.live.decode import LiveConfig, LiveRun, live_generate, prefill_once
from tracer.live.metrics import bleu, truncated_wer
from tracer.live.models import LiveModel, LivePrompt

#: name -> function(model, prompt, audio) -> transformed prompt (see tracer.transforms)
TransformFn = Callable[[LiveModel, LivePrompt, Any], LivePrompt]


@dataclass
class LiveJob:
    inputs: Sequence[LiveInput]
    specs: Sequence[PolicySpec]
    cfg: LiveConfig
    transforms: dict[str, TransformFn | None] = field(default_factory=lambda: {"none": None})
    max_seconds: float | None = None
    instruction: str | None = None
    share_prefill: bool = True  #: one prefill per (input, transform), copied for every policy


def score_row(run: LiveRun, item: LiveInput, reference: str | None) -> dict[str, Any]:
    row = {"input": item.id, **run.summary, "hypothesis": run.text, "reference": reference}
    if reference:
        if item.task == "translate":
            row["bleu"] = bleu(run.text, reference)
        else:
            s = truncated_wer(run.text, reference)
            row.update(wer=s.wer, wer_untruncated=s.wer_untruncated, length_ratio=s.length_ratio)
    return row


def run_live(lm: LiveModel, job: LiveJob, out: Path | None = None,
             log: Callable[[str], None] = print) -> pl.DataFrame:
    """Decode every combination; returns the per-run table (and writes it under ``out``)."""
    rows: list[dict[str, Any]] = []
    failed: set[tuple[str, float]] = set()
    steps_dir = None
    if out is not None:
        steps_dir = out / "steps"
        steps_dir.mkdir(parents=True, exist_ok=True)
    for item in job.inputs:
        audio, ref = item.load(job.max_seconds)
        base = lm.prepare(audio, job.instruction)
        for tname, tfn in job.transforms.items():
            t0 = time.perf_counter()
            prompt = base if tfn is None else tfn(lm, base, audio)
            t_transform = time.perf_counter() - t0
            shared = prefill_once(lm, prompt) if job.share_prefill else None
            for spec in job.specs:
                if (spec.label, spec.budget) in failed:
                    continue
                t1 = time.perf_counter()
                try:
                    run = live_generate(lm, prompt, spec, job.cfg, prefilled=shared)
                except MissingCalibrationError as exc:
                    # a policy that cannot run is reported once; the others go on (as replay)
                    failed.add((spec.label, spec.budget))
                    log(f"skipping {spec.label}@{spec.budget:g}: {exc}")
                    continue
                row = score_row(run, item, ref)
                row.update(transform=tname, transform_s=t_transform, wall_s=time.perf_counter() - t1,
                           model=lm.name, duration_s=prompt.duration_s)
                rows.append(row)
                wer = row.get("wer", row.get("bleu"))
                log(f"{item.id} {tname} {spec.label}@{spec.budget:g}: r_GPU {row['r_gpu']:.3f} "
                    f"r_GPU+CPU {row['r_gpu_cpu']:.3f} {'WER' if 'wer' in row else 'score'} "
                    f"{'-' if wer is None else f'{wer:.3f}'} term {run.terminated} "
                    f"{row['ms_per_token']:.1f} ms/tok")
                if steps_dir is not None:
                    name = f"{item.id}__{tname}__{spec.label}__{spec.budget:g}".replace("/", "_")
                    with atomic_file(steps_dir / f"{name}.parquet") as tmp:
                        run.step_log.write_parquet(tmp)
                    atomic_write_text(steps_dir / f"{name}.json", json.dumps(run.facts.to_json(), indent=1))
    if not rows:
        raise ValueError("no live run completed")
    frame = pl.DataFrame(rows)
    if out is not None:
        with atomic_file(out / "runs.parquet") as tmp:
            frame.write_parquet(tmp)
        agg = aggregate(frame)
        with atomic_file(out / "results.parquet") as tmp:
            agg.write_parquet(tmp)
    return frame


def aggregate(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per (transform, policy, budget): means over inputs, termination rate."""
    keys = ["transform", "policy", "label", "budget", "path"]
    aggs = [pl.len().alias("inputs"),
            pl.col("r_gpu").mean(), pl.col("r_gpu_cpu").mean(), pl.col("r_gpu_vs_original").mean(),
            pl.col("terminated").cast(pl.Float64).mean().alias("termination_rate"),
            pl.col("h2d_mb_per_step").mean(), pl.col("transfers_per_step").mean(),
            pl.col("ms_per_token").mean(), pl.col("input_retention").mean()]
    for col in ("wer", "wer_untruncated", "length_ratio", "bleu", "physical_h2d_mb_per_step", "peak_mem_mb"):
        if col in frame.columns:
            aggs.append(pl.col(col).mean())
    return frame.group_by(keys, maintain_order=True).agg(aggs)


def wer_chart(results: pl.DataFrame, title: str = "Live decoding: truncated WER vs measured r_GPU"):
    """Altair chart of WER against measured r_GPU, one line per policy (and transform)."""
    import altair as alt

    data = results.with_columns(
        (pl.col("label") + pl.when(pl.col("transform") == "none").then(pl.lit(""))
         .otherwise(pl.lit(" + ") + pl.col("transform"))).alias("method"))
    cols = ["method", "budget", "r_gpu", "wer", "termination_rate", "r_gpu_cpu"]
    base = alt.Chart(data.select([c for c in cols if c in data.columns])).encode(
        x=alt.X("r_gpu:Q", title="measured r_GPU (audio KV on GPU)", scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("wer:Q", title="truncated WER (WnW §3.5)"),
        color=alt.Color("method:N", title="policy"),
        tooltip=cols,
    )
    return (base.mark_line() + base.mark_point()).properties(title=title, width=420, height=300)
