"""Does replay predict live? Rank correlations of every replay metric with live WER and
termination across methods × budgets, where live runs leave the full cache's tokens, and a
held-out predictor of live WER from replay.

Replay is open loop: every policy is scored on the queries the full cache produced. Live
decoding is closed loop: once a compressed cache changes one token, every later query
differs. The study measures how much of live quality the open-loop metrics still rank and
predict (measurements: :mod:`kvsim.studies.fidelity_data`; statistics:
:mod:`kvsim.studies.fidelity_stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import polars as pl

from kvsim.live.run import PlanItem
from kvsim.studies.fidelity_data import (
    DERIVED_METRICS,
    REPLAY_METRICS,
    Sources,
    add_departures,
    join_points,
    read_live_runs,
    replay_clip,
    trace_clips,
    trace_tokens,
)
from kvsim.studies.fidelity_stats import (
    CLIP,
    bootstrap,
    bootstrap_draws,
    correlation_table,
    predictor_table,
)
from kvsim.trace.reader import Trace

#: The methods of the default study (every policy the papers compare, at four budgets).
DEFAULT_POLICIES = ("full", "wnw", "snapkv", "adakv", "pyramidkv", "audiokv", "arkvale", "voxzip",
                    "streaming", "h2o", "chunkkv", "quest")
DEFAULT_BUDGETS = (0.2, 0.4, 0.6, 0.8)
#: ``--quick`` without earlier live runs: a few methods of different kinds.
QUICK_POLICIES = ("full", "snapkv", "streaming", "h2o", "voxzip")
METRICS = (*REPLAY_METRICS, *DERIVED_METRICS)
TARGETS = ("wer", "terminated")
#: The departure summary's row over every run that compresses (replay recall < 1).
ALL_COMPRESSED = "all compressed"


def measure(items: Sequence, plan: Sequence[PlanItem], src: Sources, out: Path,
            log: Callable[[str], None] = print) -> pl.DataFrame:
    """Trace, decode live (or read ``src.live_runs``) and replay the methods live measured;
    one row per (clip, method, budget) measured both ways, with each live run's departure."""
    traces = trace_clips(items, src, out / "traces")
    live = _live_rows(items, plan, src, out, log)
    measured = set(zip(live["label"].to_list(), live["budget"].cast(pl.Float64).to_list(), strict=True))
    missing = sorted({p.spec.label for p in plan if (p.spec.label, float(p.spec.budget)) not in measured})
    if missing:
        log(f"no live runs of {', '.join(missing)} (at some budget) on these clips: left out")
    plan = [p for p in plan if (p.spec.label, float(p.spec.budget)) in measured]
    if not plan:
        raise ValueError("the live runs hold none of the requested methods on these clips "
                         f"({', '.join(i.id for i in items[:3])}{', ...' if len(items) > 3 else ''})")
    frames, steps, full = [], {}, {}
    for clip_id, path in traces.items():
        log(f"replaying {path} ({len(plan)} methods)")
        frame, steps[clip_id] = replay_clip(path, plan, src)
        frames.append(frame.with_columns(pl.lit(clip_id).alias(CLIP)))
        full[clip_id] = trace_tokens(Trace(path))
    points = join_points(pl.concat(frames), live)
    if not points.height:
        raise ValueError("no (clip, method, budget) was measured both by replay and live")
    decode, eos = _tokenizer(src, points)
    return add_departures(points, full, steps, decode, eos)


def _live_rows(items: Sequence, plan: Sequence[PlanItem], src: Sources, out: Path,
               log: Callable[[str], None]) -> pl.DataFrame:
    """Live rows of the clips: from ``src.live_runs`` when given, else decoded by live_grid."""
    if src.live_runs:
        frame = read_live_runs(src.live_runs)
        return frame.filter(pl.col("input").is_in([i.id for i in items]))
    from kvsim.live.decode import LiveConfig
    from kvsim.studies.live_grid import GridSpec, live_grid, study_live_folder
    from kvsim.trace.heads import read_heads

    cfg = LiveConfig(max_new_tokens=src.max_new_tokens,
                     head_scores=read_heads(src.heads) if src.heads else None)
    grid = GridSpec(model=src.model, device=src.device, dtype=src.dtype, ray=src.ray)
    return live_grid(items, plan, cfg, study_live_folder(out, "fidelity"), grid, log=log)


def _tokenizer(src: Sources, points: pl.DataFrame):
    """(decode, eos ids) of the backbone when some live run kept no token ids (runs from
    before they were recorded), else (None, empty)."""
    if "token_ids" in points.columns and points["token_ids"].null_count() == 0:
        return None, set()
    from kvsim.live.models import load_backbone

    lm = load_backbone(src.model, device="cpu", dtype=src.dtype)
    return lm.decode, set(lm.eos_ids)


def analyse(points: pl.DataFrame, n_boot: int = 1000, seed: int = 0) -> dict[str, pl.DataFrame]:
    """The study's statistics: correlations, held-out predictor, departure summary."""
    return {"correlations": correlation_table(points, METRICS, TARGETS, n_boot, seed),
            "predictor": predictor_table(points, METRICS, "wer", n_boot, seed),
            "departure": departure_summary(points, n_boot, seed)}


def departure_summary(points: pl.DataFrame, n_boot: int = 1000, seed: int = 0) -> pl.DataFrame:
    """Per method (label) and over every compressed run: runs, share that departs from the
    full cache's tokens, median departure token, replay's mean recall before it and at the
    departing step, and the departing step's at-risk recall percentile (with its clip
    bootstrap interval on the overall row)."""
    rows = []
    groups = [(label, g) for (label,), g in points.group_by("label", maintain_order=True)]
    compressed = points.filter(pl.col("attn_recall") < 1)  # the full cache cannot depart
    for label, g in [*groups, (ALL_COMPRESSED, compressed)]:
        dep = g.filter(pl.col("departed"))
        pct = _percentile_interval(dep, n_boot, seed) if label == ALL_COMPRESSED else None
        rows.append({"method": label, "runs": g.height, "departed": dep.height / max(g.height, 1),
                     "median_departure_token": _median(dep["departure"]),
                     "recall_before": _mean(dep["recall_before"]), "recall_at_departure": _mean(dep["recall_at"]),
                     "recall_percentile": _mean(dep["recall_percentile"]),
                     "percentile_low": pct[0] if pct else None, "percentile_high": pct[1] if pct else None})
    return pl.DataFrame(rows)


def _percentile_interval(dep: pl.DataFrame, n_boot: int, seed: int) -> tuple[float, float] | None:
    """Clip bootstrap interval of the mean departing-step recall percentile."""
    dep = dep.filter(pl.col("recall_percentile").is_not_nan())
    clips = dep[CLIP].unique(maintain_order=True).to_list()
    if len(clips) < 2:
        return None
    sums = np.array([dep.filter(pl.col(CLIP) == c)["recall_percentile"].sum() for c in clips])
    counts = np.array([dep.filter(pl.col(CLIP) == c).height for c in clips], dtype=np.float64)
    iv = bootstrap(lambda d: float(sums[d].sum() / counts[d].sum()), len(clips),
                   bootstrap_draws(len(clips), n_boot, seed))
    return iv.low, iv.high


def _mean(s: pl.Series) -> float | None:
    s = s.drop_nulls().drop_nans()
    return float(s.mean()) if len(s) else None


def _median(s: pl.Series) -> float | None:
    s = s.drop_nulls()
    return float(s.median()) if len(s) else None
