"""The runtime cost of WnW's CPU→GPU recall as the tidal-head count grows (WnW §3.9, Table 4).

WnW runs live at a target r_GPU of ~0.2 with the tidal-head count swept; each run gives its
measured r_GPU, decode ms/token (median over its decode steps, as the paper) and CPU→GPU
MB/step on this machine (minivox's decoder); then its step log goes through the hardware
simulator on Voxtral-mini-3b's geometry and a GPU preset, giving the predicted ms/token and
MB/step beside the paper's.

Head counts: the paper varies the tidal heads of Voxtral-mini-3b (30 layers × 8 KV-heads =
240 heads, 5 of them anchors, 35..235 tidal). On a model of ``H`` KV-heads with ``a`` anchors
the same *fraction of non-anchor heads* is tidal: ``round(t · (H − a) / (240 − 5))``, so the
paper's 235 maps to every non-anchor head. Step logs are carried to Voxtral's geometry by
:func:`to_geometry` (same per-head fractions, Voxtral's head count and bytes per head), so a
minivox run with the mapped tidal count is simulated with about the paper's ``t``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from kvsim.core.steplog import RunFacts
from kvsim.live.run import PlanItem
from kvsim.minivox import SHIPPED_HEADS
from kvsim.sim import ModelPreset
from kvsim.sim.tables import WNW_TABLE4
from kvsim.studies.live_grid import GridSpec
from kvsim.studies.report import StudyReport

#: WnW §3.9, Table 4 (Voxtral-mini-3b, LibriSpeech-Long test-clean, 64 samples, ~20% GPU
#: retention), every row: tidal heads -> (measured r_GPU, median ms/token, MB/step). The one
#: definition is the simulator's (``kvsim.sim.tables.WNW_TABLE4``).
PAPER_TABLE4 = WNW_TABLE4
#: Voxtral-mini-3b's KV-heads (WnW §2: L = 30, H_kv = 8) and anchors (§2.2: n_anchor = 5).
PAPER_HEADS = 240
PAPER_ANCHORS = 5


def map_tidal(tidal: int, n_heads: int, n_anchor: int) -> int:
    """The paper's tidal-head count on a model of ``n_heads`` KV-heads with ``n_anchor``
    anchors: the same fraction of the non-anchor heads (module docstring)."""
    return int(round(tidal * (n_heads - n_anchor) / (PAPER_HEADS - PAPER_ANCHORS)))


@dataclass
class Table4Config:
    """Options of ``kvsim study table4`` (defaults: the committed run)."""

    dataset_root: Path = Path("data/minivox")
    split: str = "test_30_60"
    limit: int = 4
    tidal: tuple[int, ...] = tuple(PAPER_TABLE4)  #: the paper's tidal-head counts
    budget: float = 0.2
    n_anchor: int = PAPER_ANCHORS
    max_new_tokens: int = 300
    heads: Path | None = SHIPPED_HEADS
    calibration_traces: tuple[Path, ...] = ()
    lambda_fit: str = "measured"  #: λ fit on calibration_traces: measured (WnW §3.4) | prefill
    gpus: tuple[str, ...] = ("h100-sxm", "a100-80gb")
    sim_model: str = "voxtral-mini-3b"
    runtime: str = "hf-eager"
    mode: str = "sync"
    grid: GridSpec = field(default_factory=GridSpec)


#: --quick: one clip, the paper's fewest and most tidal heads, 40 decode steps (every
#: quantity of the table is per decode step).
QUICK = dict(limit=1, tidal=(35, 235), max_new_tokens=40)


def sweep_plan(cfg: Table4Config, n_heads: int, scores) -> tuple[list[PlanItem], pl.DataFrame]:
    """WnW at ``cfg.budget`` per tidal count (λ fitted per count on the calibration traces, if
    any) and the frame mapping each paper count to its ``n_voice`` and plan label."""
    from kvsim.studies.wnw_lambda import calibration_contexts, fitted_lambdas, lambda_of, wnw_item

    ctxs = (calibration_contexts(cfg.calibration_traces, scores, cfg.lambda_fit)
            if cfg.calibration_traces else None)
    anchors = min(cfg.n_anchor, n_heads)
    voices = {t: anchors + map_tidal(t, n_heads, anchors) for t in cfg.tidal}
    distinct = list(dict.fromkeys(voices.values()))
    lams = fitted_lambdas(ctxs, [(cfg.budget, {"n_voice": v, "n_anchor": anchors}) for v in distinct],
                          cfg.grid.ray)
    lam_of = dict(zip(distinct, lams, strict=True)) if lams is not None else {}
    plan: list[PlanItem] = []
    rows = []
    for t in cfg.tidal:
        n_voice = voices[t]
        item = wnw_item(cfg.budget, lam_of.get(n_voice), {"n_voice": n_voice, "n_anchor": anchors})
        if item not in plan:
            plan.append(item)
        rows.append({"paper_tidal_heads": t, "n_voice": n_voice, "tidal_heads": n_voice - anchors,
                     "label": item.spec.label, "lam": lambda_of(item)})
    return plan, pl.DataFrame(rows)


def to_geometry(step_log: pl.DataFrame, facts: RunFacts, target: ModelPreset) -> tuple[pl.DataFrame, RunFacts]:
    """A step log carried to ``target``'s decoder: the same fraction of each layer's KV-heads
    in each state, on ``target``'s layers and KV-heads, with its bytes per head-position.

    Per-layer counts of target layer ``l`` are those of source layer ``⌊l · L_s / L_t⌋`` times
    ``H_t / H_s``; totals over (layer, head) scale by ``L_t·H_t / (L_s·H_s)``; per-head counts
    (context, non-audio positions) and the audio token rate are unchanged.
    """
    ls, hs, lt, ht = facts.n_layers, facts.n_kv_heads, target.n_layers, target.n_kv_heads
    scale = (lt * ht) / (ls * hs)
    tok, tok_total = _layers(step_log, "h2d_tokens_by_layer", "h2d_tokens", ls, lt, ht / hs, scale)
    runs, runs_total = _layers(step_log, "h2d_transfers_by_layer", "h2d_transfers", ls, lt, ht / hs, scale)
    per_head_bytes = 2 * target.head_dim * target.dtype_bytes
    out = step_log.with_columns(
        *[(pl.col(c) * scale).round(0).cast(pl.Int64) for c in
          ("gpu_audio_tokens", "cpu_audio_tokens", "read_audio_tokens", "released_tokens")],
        pl.Series("h2d_tokens_by_layer", tok, dtype=pl.List(pl.Int64)),
        pl.Series("h2d_transfers_by_layer", runs, dtype=pl.List(pl.Int64)),
        pl.Series("h2d_tokens", tok_total, dtype=pl.Int64),
        pl.Series("h2d_transfers", runs_total, dtype=pl.Int64),
    ).with_columns((pl.col("h2d_tokens") * per_head_bytes).alias("h2d_bytes"))
    moved = RunFacts(**{**facts.to_json(), "model": target.name, "n_layers": lt, "n_q_heads": target.n_q_heads,
                        "n_kv_heads": ht, "head_dim": target.head_dim, "dtype_bytes": target.dtype_bytes})
    return out, moved


def _layers(log: pl.DataFrame, col: str, total: str, ls: int, lt: int, head_ratio: float,
            scale: float) -> tuple[list[list[int]], list[int]]:
    """Per-layer lists of ``col`` on ``lt`` layers (see :func:`to_geometry`) and their sums;
    a step without a per-layer list keeps none and its total is scaled."""
    src = np.minimum(np.arange(lt) * ls // lt, ls - 1)
    lists, totals = [], []
    for row, t in zip(log[col].to_list(), log[total].to_list(), strict=True):
        if row is not None and len(row) == ls:
            mapped = np.rint(np.asarray(row, dtype=np.float64)[src] * head_ratio).astype(np.int64)
            lists.append(mapped.tolist())
            totals.append(int(mapped.sum()))
        else:
            lists.append([])
            totals.append(int(round(t * scale)))
    return lists, totals


def step_log_name(row: dict) -> str:
    """The file stem ``kvsim live`` gave a run's step log (``steps/<stem>.parquet``)."""
    return f"{row['input']}__{row['transform']}__{row['label']}__{row['budget']:g}".replace("/", "_")


def simulate_runs(runs: pl.DataFrame, steps_dir: Path, cfg: Table4Config) -> pl.DataFrame:
    """Each run's step log on ``cfg.sim_model``'s geometry through the simulator, per GPU
    preset: one row per (run, GPU) with the predicted median ms/token and MB/step. A run that
    stopped at its first token has no decode step to simulate and is left out."""
    from kvsim.sim import from_step_log, model_preset, simulate_workload

    target = model_preset(cfg.sim_model)
    rows = []
    for run in runs.iter_rows(named=True):
        stem = step_log_name(run)
        log = pl.read_parquet(steps_dir / f"{stem}.parquet", glob=False)
        if log.height == 0:
            continue
        facts = RunFacts(**json.loads((steps_dir / f"{stem}.json").read_text()))
        moved, moved_facts = to_geometry(log, facts, target)
        workload = from_step_log(moved, moved_facts)
        for gpu in cfg.gpus:
            res = simulate_workload(workload, gpu, cfg.mode, model=target, runtime=cfg.runtime).summary()
            rows.append({"input": run["input"], "label": run["label"], "gpu": res["gpu"],
                         "steps": res["steps"], "sim_ms_per_token_median": res["ms_per_token_median"],
                         "sim_h2d_mb_per_step": res["h2d_mb_per_step"],
                         "sim_transfer_wait_share": res["transfer_wait_share"]})
    return pl.DataFrame(rows)


def _pooled_mb(mb: str, steps: str) -> pl.Expr:
    """MB/step averaged over the decode steps of every run (the paper's "averaged over decode
    steps"): total MB / total steps."""
    return ((pl.col(mb) * pl.col(steps)).sum() / pl.col(steps).sum()).alias(mb)


def config_rows(runs: pl.DataFrame, sim: pl.DataFrame, mapping: pl.DataFrame) -> pl.DataFrame:
    """One row per paper tidal-head count: measured means over the clips, simulated per GPU."""
    median = "ms_per_token_median" if "ms_per_token_median" in runs.columns else "ms_per_token"
    measured = runs.group_by("label").agg(
        pl.len().alias("clips"), pl.col("r_gpu").mean(), pl.col("r_gpu_cpu").mean(),
        pl.col(median).mean().alias("ms_per_token_median"), _pooled_mb("h2d_mb_per_step", "steps"))
    out = mapping.join(measured, on="label", how="left")
    if sim.height:
        per_gpu = sim.group_by("label", "gpu").agg(
            pl.col("sim_ms_per_token_median").mean(), _pooled_mb("sim_h2d_mb_per_step", "steps"))
        for gpu in per_gpu["gpu"].unique(maintain_order=True).to_list():
            one = per_gpu.filter(pl.col("gpu") == gpu).drop("gpu")
            out = out.join(one.rename({c: f"{c}_{gpu}" for c in one.columns if c != "label"}),
                           on="label", how="left")
    paper = pl.DataFrame([(t, *v) for t, v in PAPER_TABLE4.items()], orient="row",
                         schema=["paper_tidal_heads", "paper_r_gpu", "paper_ms_per_token", "paper_mb_per_step"])
    return out.join(paper, on="paper_tidal_heads", how="left")


def _fmt(v: float | None, spec: str) -> str | None:
    return None if v is None or v != v else format(v, spec)


def markdown_frame(conf: pl.DataFrame, gpus: Sequence[str], sim_model: str, model: str = "minivox") -> pl.DataFrame:
    """The table in the paper's layout, kvsim's columns (measured, simulated) then the paper's."""
    rows = []
    for r in conf.sort("paper_tidal_heads").iter_rows(named=True):
        row = {"tidal heads (paper)": str(r["paper_tidal_heads"]),
               f"{model} tidal (n_voice)": f"{r['tidal_heads']} ({r['n_voice']})",
               "r_GPU % (measured)": _fmt(100 * r["r_gpu"] if r["r_gpu"] is not None else None, ".1f"),
               "r_GPU+CPU % (measured)": _fmt(100 * r["r_gpu_cpu"] if r["r_gpu_cpu"] is not None else None, ".1f"),
               "ms/token (measured, CPU)": _fmt(r["ms_per_token_median"], ".1f"),
               f"MB/step (measured, {model})": _fmt(r["h2d_mb_per_step"], ".3f")}
        for gpu in gpus:
            row[f"ms/token (sim. {gpu})"] = _fmt(r.get(f"sim_ms_per_token_median_{gpu}"), ".1f")
        row[f"MB/step (sim. {sim_model})"] = _fmt(r.get(f"sim_h2d_mb_per_step_{gpus[0]}"), ".2f")
        row.update({"r_GPU % (paper)": _fmt(100 * r["paper_r_gpu"], ".1f"),
                    "ms/token (paper)": _fmt(r["paper_ms_per_token"], ".1f"),
                    "MB/step (paper)": _fmt(r["paper_mb_per_step"], ".2f")})
        rows.append(row)
    return pl.DataFrame(rows)


def table4_chart(conf: pl.DataFrame, gpus: Sequence[str]):
    """MB/step and ms/token against the paper's tidal-head count: the paper, the simulator
    on Voxtral-mini-3b's geometry, and (MB/step only) minivox as measured."""
    import altair as alt

    series = {("MB/step", "paper"): "paper_mb_per_step", ("MB/step", "measured (minivox)"): "h2d_mb_per_step",
              ("ms/token", "paper"): "paper_ms_per_token"}
    for gpu in gpus:
        series[("MB/step", f"simulated ({gpu})")] = f"sim_h2d_mb_per_step_{gpu}"
        series[("ms/token", f"simulated ({gpu})")] = f"sim_ms_per_token_median_{gpu}"
    long = pl.concat([conf.select(pl.col("paper_tidal_heads").alias("tidal_heads"),
                                  pl.lit(q).alias("quantity"), pl.lit(s).alias("source"),
                                  pl.col(c).cast(pl.Float64).alias("value"))
                      for (q, s), c in series.items() if c in conf.columns])
    base = alt.Chart(long.drop_nulls("value")).encode(
        x=alt.X("tidal_heads:Q", title="tidal heads (paper's count; minivox mapped proportionally)"),
        y=alt.Y("value:Q", title=None), color=alt.Color("source:N"), tooltip=["source", "tidal_heads", "value"])
    return (base.mark_line() + base.mark_point()).properties(width=300, height=240).facet(
        column=alt.Column("quantity:N", title=None)).resolve_scale(y="independent").properties(
        title="WnW recall cost vs tidal heads (WnW §3.9, Table 4)")


def table4_notes(cfg: Table4Config, conf: pl.DataFrame, inputs: list[str], n_heads: int) -> list[str]:
    """Which numbers are measured here and which simulated, and how head counts map."""
    lams = conf["lam"].to_list()
    lam_note = ("λ fitted per tidal-head count on the calibration traces (WnW §3.4)."
                if all(v is not None for v in lams) else
                "λ fitted on each input itself (no calibration traces given: a per-input λ, "
                "not the paper's calibration-set λ), which keeps each clip's prefill r_GPU at the target.")
    from kvsim.sim import model_preset

    anchors, target = min(cfg.n_anchor, n_heads), model_preset(cfg.sim_model)
    return [
        f"WnW at a target r_GPU of {cfg.budget:g} on {len(inputs)} minivox {cfg.split} clips "
        f"({', '.join(inputs)}), greedy decoding to at most {cfg.max_new_tokens} tokens, {anchors} "
        f"anchor heads; {lam_note}",
        f"Head counts: the paper's Voxtral-mini-3b has {PAPER_HEADS} KV-heads ({PAPER_ANCHORS} anchors); "
        f"this model has {n_heads}. A paper count t maps to round(t · ({n_heads} − {anchors}) / "
        f"({PAPER_HEADS} − {PAPER_ANCHORS})) tidal heads, the same fraction of the non-anchor heads "
        f"(the paper's 235 = every non-anchor head); n_voice = anchors + tidal.",
        "Measured on this CPU (minivox, float32, masking emulation): r_GPU and r_GPU+CPU (means "
        "over decode steps, then over clips), ms/token (median over each run's decode steps, "
        "then the mean over clips) and MB/step (CPU→GPU bytes the policy moved, averaged over "
        "all decode steps of all clips, at this model's bytes per head-position). These CPU "
        "timings are not GPU timings: compare them between rows, not with the paper.",
        f"Simulated: each run's step log carried to {cfg.sim_model}'s geometry (the same fraction "
        f"of each layer's KV-heads in each tier on its {target.n_layers} × {target.n_kv_heads} "
        f"KV-heads and {2 * target.head_dim * target.dtype_bytes} B per head-position: "
        f"×{target.n_layers * target.n_kv_heads / n_heads:.3g} head-positions) and run through `kvsim simulate`'s model "
        f"(`kvsim.sim.simulate_workload`, {cfg.mode} recall as the paper's naive scheduling, "
        f"{cfg.runtime} host costs, GPU presets {', '.join(cfg.gpus)}): predicted median ms/token "
        "and MB/step. The paper's columns are its measurements on 64 LibriSpeech-Long test-clean "
        "samples (4-minute audio); these clips are 30–60 s, so the recall traffic per step is "
        "comparable but the KV read per step is smaller than the paper's.",
    ]


def run_table4(cfg: Table4Config, out: Path, log: Callable[[str], None] = print) -> StudyReport:
    """Decode the sweep (``out / "live-table4"``, a ``kvsim live`` folder reused by a later call),
    simulate every run and build the report."""
    from kvsim.live.data import load_dataset
    from kvsim.live.decode import LiveConfig
    from kvsim.studies.live_grid import live_grid, study_live_folder
    from kvsim.trace.heads import read_heads

    if cfg.heads is None:
        raise ValueError("table4 runs WnW: give --heads (a heads.json)")
    scores = read_heads(cfg.heads)
    n_heads = int(scores.voice_score.size)
    plan, mapping = sweep_plan(cfg, n_heads, scores)
    items = load_dataset("manifest", cfg.dataset_root, split=cfg.split, limit=cfg.limit)
    folder = study_live_folder(out, "table4")
    runs = live_grid(items, plan, LiveConfig(max_new_tokens=cfg.max_new_tokens, head_scores=scores),
                     folder, cfg.grid, log=log)
    sim = simulate_runs(runs, folder / "steps", cfg)
    conf = config_rows(runs, sim, mapping)
    inputs = [i.id for i in items]
    return StudyReport(
        name="table4", title="WnW recall cost vs tidal-head count (WnW §3.9, Table 4)",
        tables=[(f"WnW at r_GPU ≈ {cfg.budget:g}: measured on {cfg.grid.model} on this CPU, simulated "
                 f"on {cfg.sim_model}'s geometry, beside the paper's Table 4.",
                 markdown_frame(conf, cfg.gpus, cfg.sim_model, cfg.grid.model))],
        data=conf, chart=table4_chart(conf, cfg.gpus), notes=table4_notes(cfg, conf, inputs, n_heads),
        extra_data={"runs": runs, "sim": sim})
