"""Run live decoding over inputs x transforms x policies x budgets and write the results."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from kvsim.decoding import OPTION_KEYS
from kvsim.live.data import LiveInput
from kvsim.live.decode import LiveConfig, LiveRun, live_generate, prefill_once
from kvsim.live.metrics import WerConfig, bleu, truncated_wer
from kvsim.live.models import LiveModel
from kvsim.policies.base import PolicyNotApplicable
from kvsim.policies.spec import PolicySpec
from kvsim.trace.atomic import atomic_file, atomic_write_text

if TYPE_CHECKING:
    from kvsim.rundir import RunDir


@dataclass(frozen=True)
class PlanItem:
    """One method: an input transform (or none) followed by a policy at a budget."""

    transform: str
    spec: PolicySpec


@dataclass
class LiveJob:
    inputs: Sequence[LiveInput]
    plan: Sequence[PlanItem]
    cfg: LiveConfig
    max_seconds: float | None = None
    instruction: str | None = None
    language: str | None = None  #: source (transcribe) / target (translate) language
    share_prefill: bool = True  #: one prefill per (input, transform), copied for every policy
    wer: WerConfig = WerConfig()  #: truncation unit and averaging of truncated WER (WnW §3.5)


def make_plan(policy_args: Sequence[str], budgets: Sequence[float], transforms: str = "none") -> list[PlanItem]:
    """Methods from ``--policy`` items and ``--transform``.

    ``name[:k=v...]`` runs on every transform of ``--transform``; ``TRANSFORM/name[:k=v...]``
    runs only on that transform (``voxzip1/voxzip`` = VoxZip stages 1+2). ``affpool`` without
    a retention in a combination takes the budget as its retention (``affpool/full`` is AffPool
    at r_GPU = budget, as a token-merging baseline). Plain ``full`` keeps everything whatever
    the budget, so it runs once (at budget 1.0).
    """
    from kvsim.specs import parse_policies, split_items
    from kvsim.tracer.transforms import parse_transforms

    crossed = list(parse_transforms(transforms))
    plan: list[PlanItem] = []
    for item in split_items(list(policy_args), "-p/--policy", "policy"):
        tname, sep, pol = item.rpartition("/")
        for b in budgets:
            for spec in parse_policies([pol], b):
                if not sep:
                    if spec.name == "full" and not spec.params:
                        spec = PolicySpec("full", 1.0)  # budget-independent: run it once
                    plan += [PlanItem(t, spec) for t in crossed if PlanItem(t, spec) not in plan]
                    continue
                t = f"affpool:{b:g}" if tname == "affpool" else tname
                parse_transforms(t)  # validate
                plan.append(PlanItem(t, spec))
    return plan


def score_row(run: LiveRun, item: LiveInput, reference: str | None, tokenizer: Any = None,
              wer: WerConfig | None = None) -> dict[str, Any]:
    """One run's row; transcripts get truncated WER in ``tokenizer``'s tokens (WnW §3.5)."""
    row = {"input": item.id, **run.summary, "hypothesis": run.text, "reference": reference,
           "token_ids": list(run.tokens)}
    if reference:
        if item.task == "translate":
            row["bleu"] = bleu(run.text, reference)
        else:
            s = truncated_wer(run.text, reference, tokenizer, wer)
            row.update(wer=s.wer, wer_untruncated=s.wer_untruncated, length_ratio=s.length_ratio,
                       wer_errors=s.errors, ref_words=s.ref_words)
    return row


def run_live(lm: LiveModel, job: LiveJob, out: RunDir | Path | None = None,
             log: Callable[[str], None] = print) -> pl.DataFrame:
    """Decode every combination; returns the per-run table of every completed input.

    With ``out`` (a :class:`~kvsim.rundir.RunDir`, or a folder opened as a fresh one), each
    input's rows become a part file and its step logs land in ``steps/`` as soon as it
    finishes, so a crash loses at most the input in flight; ``runs.parquet`` and the
    aggregated ``results.parquet`` are written once at the end. An input that cannot be read
    or decoded is logged in one line (``path: message``) and recorded as failed; the others
    go on.
    """
    from kvsim.rundir import RunDir, input_error

    if isinstance(out, Path):
        run = RunDir.open(out, "live", [i.id for i in job.inputs], {})
        with run:
            return run_live(lm, job, run, log)
    rows: list[dict[str, Any]] = []
    skip: set[tuple[str, str, float]] = set()  # policies that cannot run (missing calibration)
    for item in pending_inputs(job, out):
        try:
            item_rows, logs = decode_input(lm, job, item, skip, log)
        except Exception as exc:  # isolation: report this input, keep the others
            record_failure(out, item, input_error(item.audio_path, exc), log)
            continue
        rows += item_rows
        record_input(out, item, item_rows, logs)
    return finish_run(out, rows, job)


def pending_inputs(job: LiveJob, out: RunDir | None) -> list[LiveInput]:
    """The inputs of ``job`` left to decode: all but those a resumed ``out`` kept."""
    return [i for i in job.inputs if out is None or i.id not in out.completed]


def record_input(out: RunDir | None, item: LiveInput, rows: list[dict[str, Any]],
                 logs: list[tuple[str, LiveRun]]) -> None:
    """Keep one decoded input in ``out``: its step logs in ``steps/``, its rows as a part."""
    if out is not None:
        steps = [_write_step_log(out.path, name, r) for name, r in logs]
        out.done(item.id, pl.DataFrame(rows) if rows else None, steps=steps)


def record_failure(out: RunDir | None, item: LiveInput, message: str,
                   log: Callable[[str], None]) -> None:
    """Report one input that could not be read or decoded (one line) and mark it failed."""
    log(f"error: {message}")
    if out is not None:
        out.failed(item.id, message)


def finish_run(out: RunDir | None, rows: list[dict[str, Any]], job: LiveJob) -> pl.DataFrame:
    """The per-run table of every completed input (kept parts included); with ``out``, also
    written as ``runs.parquet`` and aggregated as ``results.parquet``."""
    frame = out.parts() if out is not None else (pl.DataFrame(rows) if rows else None)
    if frame is None:
        raise ValueError("no live run completed")
    if out is not None:
        out.write_combined(frame, "runs.parquet")
        out.write_combined(aggregate(frame, job.wer.averaging), "results.parquet")
    return frame


def decode_input(lm: LiveModel, job: LiveJob, item: LiveInput, skip: set,
                  log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[tuple[str, LiveRun]]]:
    """Every (transform, policy, budget) of the plan on one input: its rows and step logs."""
    from kvsim.tracer.transforms import parse_transforms

    order = list(dict.fromkeys(p.transform for p in job.plan))
    fns = {t: parse_transforms(t)[t] for t in order}
    audio, ref = item.load(job.max_seconds)
    base = lm.prepare(audio, job.instruction, task=item.task, language=job.language)
    rows, logs = [], []
    for tname in order:
        t0 = time.perf_counter()
        prompt = base if fns[tname] is None else fns[tname](lm, base, audio)
        t_transform = time.perf_counter() - t0
        # a shared prefill cache would sit on the accelerator and inflate physical-path memory
        share = job.share_prefill and not (job.cfg.physical and lm.device.type == "cuda")
        shared = prefill_once(lm, prompt, job.cfg.observation_window) if share else None
        for spec in [p.spec for p in job.plan if p.transform == tname]:
            key = (tname, spec.label, spec.budget)
            if key in skip:
                continue
            t1 = time.perf_counter()
            try:
                run = live_generate(lm, prompt, spec, job.cfg, prefilled=shared)
            except PolicyNotApplicable as exc:
                # a policy that cannot run is reported once; the others go on (as replay)
                skip.add(key)
                log(f"skipping {spec.label}@{spec.budget:g}: {exc}")
                continue
            row = score_row(run, item, ref, lm.tokenizer, job.wer)
            row.update(transform=tname, transform_s=t_transform, wall_s=time.perf_counter() - t1,
                       model=lm.name, duration_s=prompt.duration_s)
            rows.append(row)
            _log_row(log, item, tname, spec, row, run)
            logs.append((f"{item.id}__{tname}__{spec.label}__{spec.budget:g}".replace("/", "_"), run))
    return rows, logs


def _log_row(log: Callable[[str], None], item: LiveInput, tname: str, spec: PolicySpec,
             row: dict[str, Any], run: LiveRun) -> None:
    wer = row.get("wer", row.get("bleu"))
    log(f"{item.id} {tname} {spec.label}@{spec.budget:g}: r_GPU {row['r_gpu']:.3f} "
        f"r_GPU+CPU {row['r_gpu_cpu']:.3f} {'WER' if 'wer' in row else 'score'} "
        f"{'-' if wer is None else f'{wer:.3f}'} term {run.terminated} "
        f"{row['ms_per_token']:.1f} ms/tok")


def _write_step_log(out: Path, name: str, run: LiveRun) -> str:
    """``steps/<name>.parquet`` + its RunFacts JSON, atomically; returns the relative name."""
    steps_dir = out / "steps"
    with atomic_file(steps_dir / f"{name}.parquet") as tmp:
        run.step_log.write_parquet(tmp)
    atomic_write_text(steps_dir / f"{name}.json", json.dumps(run.facts.to_json(), indent=1))
    return f"steps/{name}.parquet"


def aggregate(frame: pl.DataFrame, averaging: str = "corpus") -> pl.DataFrame:
    """One row per (transform, policy, budget): means over inputs, termination rate, and with
    the decoding options their values, mean pushes and bans, and the share of runs the read
    window ended (``read_stop_rate``).

    ``wer`` is the truncated WER of the set: pooled over utterances (``averaging="corpus"``,
    ``wer_corpus``: errors / reference words, as jiwer over the lists) or the mean of the
    per-utterance WERs (``"utterance"``, ``wer_utterance_mean``); both columns are kept.
    """
    keys = ["transform", "policy", "label", "budget", "path"]
    aggs = [pl.len().alias("inputs"),
            pl.col("r_gpu").mean(), pl.col("r_gpu_cpu").mean(), pl.col("r_gpu_vs_original").mean(),
            pl.col("terminated").cast(pl.Float64).mean().alias("termination_rate"),
            pl.col("h2d_mb_per_step").mean(), pl.col("transfers_per_step").mean(),
            pl.col("ms_per_token").mean(), pl.col("input_retention").mean()]
    for col in ("wer_untruncated", "length_ratio", "bleu", "physical_h2d_mb_per_step", "peak_mem_mb",
                "read_forced", "cycle_bans", "end_holds"):
        if col in frame.columns:
            aggs.append(pl.col(col).mean())
    for col in OPTION_KEYS:  # the decoding options: one value per run folder
        if col in frame.columns:
            aggs.append(pl.col(col).first())
    if "read_stopped" in frame.columns:
        aggs.append(pl.col("read_stopped").cast(pl.Float64).mean().alias("read_stop_rate"))
    if "wer" in frame.columns:
        aggs.append(pl.col("wer").mean().alias("wer_utterance_mean"))
        if "wer_errors" in frame.columns:  # runs written before the errors were kept have none
            aggs.append((pl.col("wer_errors").sum() / pl.col("ref_words").sum()).alias("wer_corpus"))
    out = frame.group_by(keys, maintain_order=True).agg(aggs)
    if "wer" not in frame.columns:
        return out
    if averaging not in ("corpus", "utterance"):
        raise ValueError(f"WER averaging must be corpus or utterance, got {averaging!r}")
    pick = "wer_corpus" if averaging == "corpus" and "wer_corpus" in out.columns else "wer_utterance_mean"
    return out.with_columns(pl.col(pick).alias("wer"))


def with_method(results: pl.DataFrame) -> pl.DataFrame:
    """Add the ``method`` column: the policy label, plus `` + transform`` when the input was
    transformed (``affpool:0.2``, ``affpool:0.4`` ... are one method)."""
    return results.with_columns(
        (pl.col("label") + pl.when(pl.col("transform") == "none").then(pl.lit(""))
         .otherwise(pl.lit(" + ") + pl.col("transform").str.replace(r":[0-9.]+$", "")))
        .alias("method"))


def wer_chart(results: pl.DataFrame, title: str = "Live decoding: truncated WER vs measured r_GPU"):
    """Altair chart of WER against measured r_GPU, one line per policy (and transform)."""
    import altair as alt

    # x = GPU audio KV against the *untransformed* audio span, so input transforms compare
    data = with_method(results)
    cols = ["method", "budget", "r_gpu_vs_original", "r_gpu", "wer", "termination_rate", "r_gpu_cpu"]
    base = alt.Chart(data.select([c for c in cols if c in data.columns])).encode(
        x=alt.X("r_gpu_vs_original:Q", title="measured r_GPU (audio KV on GPU / untransformed audio KV)",
                scale=alt.Scale(domain=[0, 1])),
        y=alt.Y("wer:Q", title="truncated WER (WnW §3.5)"),
        color=alt.Color("method:N", title="policy"),
        tooltip=cols,
    )
    return (base.mark_line() + base.mark_point()).properties(title=title, width=420, height=300)
