"""The measurements of the fidelity study: full-cache traces of the clips, every policy ×
budget replayed over them, the same methods decoded live, joined into one row per
(clip, method, budget), with where each live run left the full cache's tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from kvsim.live.run import PlanItem
from kvsim.studies.fidelity_stats import (
    CLIP,
    at_risk_percentile,
    departure_index,
    departure_recall,
    text_departure,
)
from kvsim.trace.reader import Trace

#: Replay columns carried into the joined frame (the metrics the study ranks).
REPLAY_METRICS = ("attn_recall", "attn_recall_min_step", "topk_jaccard", "output_error",
                  "r_gpu", "r_gpu_cpu", "read_fraction")
#: Metrics the study derives from replay's per-step and per-layer recall.
DERIVED_METRICS = ("recall_align", "output_error_align", "recall_p10")


@dataclass
class Sources:
    """Where the study's measurements come from and how they are made."""

    model: str = "minivox"
    max_new_tokens: int = 300
    heads: Path | None = None  #: calibration (WnW, AudioKV); also stored in no trace
    aligner: str = "auto"  #: word alignment of the traces (``none`` for the test backbone)
    device: str = "cpu"
    dtype: str = "float32"
    error_stride: int = 16  #: replay's output-error sampling (``kvsim replay --error-stride``)
    align_layers: list[int] | None = None  #: None: the 4 most monotonic layers of each trace
    live_runs: list[Path] = field(default_factory=list)  #: earlier ``kvsim live`` folders
    ray: str | None = None


def trace_clips(items: Sequence, src: Sources, out: Path) -> dict[str, Path]:
    """Full-cache traces (with values) of every input under ``out``, as ``kvsim trace`` makes
    them; complete traces already there are kept. Returns input id -> trace path."""
    from rich.console import Console

    from kvsim.tracer.backbones import LoadOptions, PromptSpec
    from kvsim.tracer.batch import BatchConfig, run_batch, trace_name
    from kvsim.tracer.run import TraceOptions

    paths = [Path(i.audio_path) for i in items]
    cfg = BatchConfig(model=src.model, out_dir=out, aligner=src.aligner,
                      options=TraceOptions(max_new_tokens=src.max_new_tokens, store_values=True,
                                           prompt=PromptSpec(task="transcribe")),
                      load=LoadOptions(device=src.device, dtype=src.dtype))
    results = run_batch(paths, cfg, Console(stderr=True))
    failed = [r for r in results if r.status == "failed"]
    if failed:
        raise ValueError(f"{failed[0].path}: tracing failed: {failed[0].reason}")
    return {i.id: out / trace_name(p, paths) for i, p in zip(items, paths, strict=True)}


def trace_tokens(trace: Trace) -> list[int]:
    """The tokens the full cache generated on the trace's clip, the final one included."""
    gen = trace.meta.provenance.get("generation", {})
    if isinstance(gen, dict) and gen.get("token_ids"):
        return [int(t) for t in gen["token_ids"]]
    return trace.positions.filter(pl.col("kind") == "generated").sort("position")["token_id"].to_list()


def replay_clip(path: Path, plan: Sequence[PlanItem], src: Sources) -> tuple[pl.DataFrame, dict]:
    """Every untransformed method of ``plan`` replayed over one trace: one row per method with
    replay's metrics and the derived ones, and ``{(label, budget): per-step recall}``."""
    from kvsim.replay.engine import ReplayConfig, Replayer
    from kvsim.studies.alignment import alignment
    from kvsim.trace.heads import read_heads

    trace = Trace(path)
    scores = read_heads(src.heads) if src.heads else None
    rep = Replayer(trace, ReplayConfig(error_stride=src.error_stride, head_scores=scores))
    results = rep.run([p.spec for p in plan if p.transform == "none"])
    if rep.failures:
        spec, msg = rep.failures[0]
        raise ValueError(f"{path}: {spec.label}@{spec.budget:g}: {msg}")
    layers = src.align_layers if src.align_layers is not None else alignment(trace).layers
    rows, steps = [], {}
    for r in results:
        recall = r.step_recall if r.step_recall is not None else np.array([np.nan])
        row = {CLIP: trace.name, "label": r.spec.label, "budget": float(r.spec.budget),
               **{m: float(r.summary[m]) for m in REPLAY_METRICS},
               "recall_align": float(r.per_head_recall[layers].mean()),
               "output_error_align": _mean_of(r.layer_error, layers),
               "recall_p10": float(np.percentile(recall, 10)) if len(recall) else float("nan")}
        rows.append(row)
        steps[(r.spec.label, float(r.spec.budget))] = recall
    return pl.DataFrame(rows), steps


def _mean_of(per_layer: np.ndarray | None, layers: list[int]) -> float:
    """Mean of a per-layer metric over ``layers`` (NaN when the engine gave none)."""
    return float("nan") if per_layer is None else float(np.mean(per_layer[layers]))


def read_live_runs(folders: Sequence[Path]) -> pl.DataFrame:
    """The per-run rows of earlier ``kvsim live`` folders: ``runs.parquet`` when the run
    finished, else its ``parts/`` (the inputs done so far)."""
    frames = []
    for folder in folders:
        files = [folder / "runs.parquet"] if (folder / "runs.parquet").exists() else sorted((folder / "parts").glob("*.parquet"))
        if not files:
            raise ValueError(f"{folder}: no runs.parquet and no parts/*.parquet (not a kvsim live run folder, or no input finished yet)")
        frames += [pl.read_parquet(f) for f in files]
    frame = pl.concat(frames, how="diagonal_relaxed")
    for col in ("input", "label", "budget", "wer", "terminated", "hypothesis"):
        if col not in frame.columns:
            raise ValueError(f"{folders[0]}: runs have no {col!r} column")
    return frame


def live_runs_max_new_tokens(folders: Sequence[Path]) -> int:
    """The ``max_new_tokens`` every live run folder decoded with (from its ``run.json``)."""
    import json

    found = set()
    for folder in folders:
        manifest = folder / "run.json"
        if not manifest.exists():
            raise ValueError(f"{folder}: no run.json (not a kvsim live run folder)")
        value = json.loads(manifest.read_text()).get("config", {}).get("max_new_tokens")
        if not isinstance(value, int):
            raise ValueError(f"{manifest}: config.max_new_tokens: missing")
        found.add(value)
    if len(found) > 1:
        raise ValueError(f"--live-runs decoded with different max_new_tokens ({sorted(found)}): give folders of one setting")
    return found.pop()


def join_points(replay: pl.DataFrame, live: pl.DataFrame) -> pl.DataFrame:
    """One row per (clip, method, budget) that both replay and live measured: replay's
    metrics, live's WER and termination (``live_`` prefixed where names clash)."""
    keep = ["input", "label", "budget", "wer", "terminated", "hypothesis", "r_gpu", "r_gpu_cpu"]
    if "token_ids" in live.columns:
        keep.append("token_ids")
    if "transform" in live.columns:
        live = live.filter(pl.col("transform") == "none")
    live = live.select(keep).rename({"input": CLIP, "r_gpu": "live_r_gpu", "r_gpu_cpu": "live_r_gpu_cpu"})
    live = live.with_columns(pl.col("budget").cast(pl.Float64), pl.col("terminated").cast(pl.Float64))
    return replay.join(live, on=[CLIP, "label", "budget"], how="inner")


def add_departures(points: pl.DataFrame, full_tokens: dict[str, list[int]], steps: dict,
                   decode: Callable[[list[int]], str] | None, eos: set[int]) -> pl.DataFrame:
    """Each live run's departure from the full cache's tokens on its clip (token index, null
    when it never departs), replay's recall before it (:func:`departure_recall`) and its
    at-risk percentile (:func:`at_risk_percentile`). Runs without token ids are compared as
    text (``decode``: token ids -> text)."""
    prefixes: dict[str, list[str]] = {}
    departures = []
    for row in points.iter_rows(named=True):
        ref = full_tokens[row[CLIP]]
        if row.get("token_ids") is not None:
            departures.append(departure_index(list(row["token_ids"]), ref))
            continue
        if decode is None:
            raise ValueError(f"{row[CLIP]}: live runs without token ids need the tokenizer")
        if row[CLIP] not in prefixes:
            body = [t for t in ref if t not in eos]
            prefixes[row[CLIP]] = [decode(body[:k]) for k in range(len(body) + 1)]
        departures.append(text_departure(row["hypothesis"], prefixes[row[CLIP]]))
    recalls = [steps[c][(lab, b)] for c, lab, b in zip(points[CLIP], points["label"], points["budget"], strict=True)]
    out = points.with_columns(pl.Series("departure", departures, dtype=pl.Int64),
                              pl.Series("departed", [d is not None for d in departures]))
    out = pl.concat([out, pl.DataFrame([departure_recall(r, d) for r, d in zip(recalls, departures, strict=True)],
                                       schema={"recall_before": pl.Float64, "recall_at": pl.Float64})],
                    how="horizontal")
    pct = np.full(out.height, np.nan)
    for clip in out[CLIP].unique().to_list():
        idx = np.flatnonzero((out[CLIP] == clip).to_numpy())
        pct[idx] = at_risk_percentile([recalls[i] for i in idx], [departures[i] for i in idx])
    return out.with_columns(pl.Series("recall_percentile", pct))
