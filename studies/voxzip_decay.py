"""VoxZip's temporal-decay ablation (its Table 5): the γ sweep of stage 2, in replay and live.

VoxZip §"dynamic KV cache eviction" scores tokens by a time-decayed accumulated attention
``A ← γ·[A, 0] + softmax(q Kᵀ/√d)``; its Table 5 sweeps γ at a 5% KV budget (γ = 1.0 is plain
accumulation, no decay) on Qwen3-Omni-Instruct-30B over Vox-Infinity and picks γ = 0.95. Here
kvsim's ``voxzip`` policy (its parameter ``gamma``) is swept over the γ the paper names, at the
paper's 5% and at r = 0.2:

* replay: attention recall, output error and top-K overlap of every γ × budget on traces;
* live: WER and termination of the same grid (and the full cache) decoding minivox clips.

The paper's accuracies are on a different task (audio question answering) and metric; they sit
in their own clearly labelled column, for the direction of the effect only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from kvsim.policies.spec import PolicySpec
from kvsim.replay.engine import ReplayConfig, RunResult, replay_trace
from kvsim.studies.report import StudyReport
from kvsim.trace.reader import Trace

#: The γ VoxZip's Table 5 text names: 1.0 (no decay), 0.95 (chosen), "γ ≤ 0.90" and "γ ≥ 0.99"
#: (VoxZip, temporal-decay ablation). Its table may hold more values; its text names these.
PAPER_GAMMAS = (0.90, 0.95, 0.99, 1.0)
#: VoxZip Table 5 budget: "a highly constrained 5% KV cache budget".
PAPER_BUDGET = 0.05
#: VoxZip Table 5, Personal Monologues (PM) subset accuracy (%), Qwen3-Omni-Instruct-30B on
#: Vox-Infinity at the 5% budget, the two values its text quotes: "The non-TD baseline's PM
#: accuracy plummets to 62.6%, while the optimal TD setting (γ = 0.95) raises it to 76.5%".
PAPER_TABLE5_PM_ACCURACY = {1.0: 62.6, 0.95: 76.5}
#: Budgets swept here: the paper's 5% and r = 0.2 (the budget of WnW's main comparisons).
BUDGETS = (PAPER_BUDGET, 0.2)
#: --quick: the chosen γ and no decay.
QUICK_GAMMAS = (0.95, 1.0)
#: Replay metrics taken from the replay results frame.
REPLAY_METRICS = ("r_gpu", "attn_recall", "output_error", "topk_jaccard")


def decay_specs(gammas: Sequence[float], budgets: Sequence[float],
                scope: str | None = None) -> list[PolicySpec]:
    """``voxzip`` at every γ × budget (γ is VoxZip's decay; the other parameters the paper's,
    ``scope`` VoxZip's generation scope unless given). A γ outside (0, 1] is a ValueError
    naming it, before any work."""
    extra = {} if scope is None else {"scope": scope}
    specs = [PolicySpec("voxzip", float(b), {"gamma": float(g), **extra})
             for b in budgets for g in gammas]
    for spec in specs[:len(gammas)]:
        spec.make()  # checks gamma
    return specs


def _gamma_column(frame: pl.DataFrame, specs: Sequence[PolicySpec]) -> pl.DataFrame:
    gamma = {s.label: s.params["gamma"] for s in specs}
    return frame.with_columns(pl.col("label").replace_strict(gamma, default=None, return_dtype=pl.Float64)
                              .alias("gamma"))


def replay_sweep(traces: Sequence[Trace], gammas: Sequence[float], budgets: Sequence[float],
                 cfg: ReplayConfig | None = None,
                 scope: str | None = None) -> tuple[pl.DataFrame, list[RunResult]]:
    """Replay every γ × budget on every trace (one shared attention pass per trace).

    Returns the replay results frame (one row per trace × γ × budget, with a ``gamma``
    column) and the runs themselves.
    """
    specs = decay_specs(gammas, budgets, scope)
    results: list[RunResult] = []
    for trace in traces:
        results += replay_trace(trace, specs, cfg or ReplayConfig())
    frame = pl.DataFrame([r.summary for r in results])
    return _gamma_column(frame, specs), results


@dataclass
class LiveSweep:
    """The live part: which clips, how to decode, where the run folder goes."""

    items: Sequence  #: LiveInput clips
    out: Path  #: the ``kvsim live`` run folder
    max_new_tokens: int = 300
    model: str = "minivox"
    device: str = "cpu"
    ray: str | None = None


def live_sweep(sweep: LiveSweep, gammas: Sequence[float], budgets: Sequence[float],
               log: Callable[[str], None] = print) -> pl.DataFrame:
    """Decode the clips with the full cache and ``voxzip`` at every γ × budget through
    :func:`kvsim.studies.live_grid.live_grid`; returns one row per clip × method with a
    ``gamma`` column (null for the full cache)."""
    from kvsim.live.decode import LiveConfig
    from kvsim.live.run import PlanItem
    from kvsim.studies.live_grid import GridSpec, live_grid

    specs = decay_specs(gammas, budgets)
    plan = [PlanItem("none", PolicySpec("full", 1.0))] + [PlanItem("none", s) for s in specs]
    runs = live_grid(sweep.items, plan, LiveConfig(max_new_tokens=sweep.max_new_tokens), sweep.out,
                     GridSpec(model=sweep.model, device=sweep.device, ray=sweep.ray), log=log)
    return _gamma_column(runs, specs)


PAPER_COLUMN = "VoxZip paper: PM accuracy % (Qwen3-Omni-30B, Vox-Infinity QA; other task and metric)"


def _live_summary(live: pl.DataFrame) -> pl.DataFrame:
    """Live WER (pooled over clips), termination rate and r_GPU per method."""
    from kvsim.live.run import aggregate

    agg = aggregate(live)
    gamma = dict(zip(live["label"], live["gamma"], strict=True))
    return agg.select(
        pl.col("label").replace_strict(gamma, default=None, return_dtype=pl.Float64).alias("gamma"),
        "budget", pl.col("policy"), pl.col("wer").alias("live WER"),
        pl.col("termination_rate").alias("live terminated"), pl.col("r_gpu").alias("live r_GPU"),
        pl.col("inputs").alias("live clips"))


def sweep_table(replay: pl.DataFrame, live: pl.DataFrame | None) -> pl.DataFrame:
    """One row per budget × γ: replay metrics (mean over traces) and their change against
    γ = 1.0, live WER and termination, and the paper's PM accuracy where it quotes one; the
    full cache first when live ran."""
    names = {"budget": "r", "gamma": "γ", "r_gpu": "replay r_GPU", "attn_recall": "replay attn recall",
             "output_error": "replay output error", "topk_jaccard": "replay top-K Jaccard"}
    rows = (replay.group_by("budget", "gamma").agg(pl.len().alias("replay traces"),
                                                   *[pl.col(m).mean() for m in REPLAY_METRICS])
            .with_columns(pl.lit("voxzip").alias("policy")))
    no_decay = rows.filter(pl.col("gamma") == 1.0).select("budget", pl.col("attn_recall").alias("_r1"))
    rows = rows.join(no_decay, on="budget", how="left").with_columns(
        (pl.col("attn_recall") - pl.col("_r1")).alias("replay recall − γ=1.0")).drop("_r1")
    if live is not None:
        summary = _live_summary(live)
        sweep = summary.filter(pl.col("policy") == "voxzip").drop("policy")
        rows = rows.join(sweep, on=["budget", "gamma"], how="full", coalesce=True)
        rows = pl.concat([summary.filter(pl.col("policy") == "full"),
                          rows.with_columns(pl.lit("voxzip").alias("policy"))], how="diagonal_relaxed")
    paper = pl.col("gamma").replace_strict(PAPER_TABLE5_PM_ACCURACY, default=None, return_dtype=pl.Float64)
    rows = rows.with_columns(pl.when(pl.col("budget") == PAPER_BUDGET).then(paper).alias(PAPER_COLUMN))
    rows = rows.sort(pl.col("policy") != "full", "budget", "gamma").rename(names, strict=False)
    live_cols = [c for c in ("live WER", "live terminated", "live r_GPU", "live clips") if c in rows.columns]
    return rows.select("policy", "r", "γ", "replay traces", *[names[m] for m in REPLAY_METRICS],
                       "replay recall − γ=1.0", *live_cols, PAPER_COLUMN)


def decay_chart(table: pl.DataFrame):
    """Replay attention recall and live WER against γ (one line per budget), and the paper's
    two quoted PM accuracies, side by side."""
    import altair as alt

    sweep = table.filter(pl.col("policy") == "voxzip").with_columns(pl.col("r").cast(pl.Utf8).alias("budget r"))
    x = alt.X("γ:Q", scale=alt.Scale(zero=False), title="γ (1.0 = no decay)")

    def panel(column: str, title: str, data: pl.DataFrame = sweep) -> alt.Chart:
        return alt.Chart(data).mark_line(point=True).encode(
            x=x, y=alt.Y(f"{column}:Q", title=column, scale=alt.Scale(zero=False)),
            color=alt.Color("budget r:N", title="budget r")).properties(width=220, height=200, title=title)

    panels = [panel("replay attn recall", "replay: attention recall")]
    if "live WER" in table.columns:
        panels.append(panel("live WER", "live: truncated WER (minivox)"))
    paper = pl.DataFrame({"γ": list(PAPER_TABLE5_PM_ACCURACY), "PM accuracy %": list(PAPER_TABLE5_PM_ACCURACY.values())})
    panels.append(alt.Chart(paper).mark_point(filled=True, size=60, color="black").encode(
        x=x, y=alt.Y("PM accuracy %:Q", scale=alt.Scale(zero=False))).properties(
        width=160, height=200, title="VoxZip Table 5 (5%, PM; its text)"))
    return alt.hconcat(*panels).properties(title="VoxZip temporal decay: the γ sweep")


def decay_report(replay: pl.DataFrame, live: pl.DataFrame | None, windows: dict[str, int]) -> StudyReport:
    """The study's report from the replay frame, the live runs (None with --no-live) and each
    replayed trace's observation-window length (queries the prefill score sees)."""
    table = sweep_table(replay, live)
    n_traces = len(windows)
    window_text = ", ".join(f"{w} on {name}" for name, w in windows.items())
    notes = [
        f"kvsim `voxzip` (VoxZip stage 2: sinks T = 4, a recent window of 20% of the budget, top-N by "
        f"the decayed score) with its `gamma` swept, on {n_traces} trace(s) in replay (means over "
        "traces) and, live, on minivox clips with the full cache as reference. Replay metrics are the "
        "open-loop ones of `kvsim replay` (top-K Jaccard at K = 100); live WER is the truncated WER "
        "pooled over the clips (WnW §3.5), 'live terminated' the share of clips that ended before "
        "--max-new-tokens.",
        "kvsim's `voxzip` runs in VoxZip's generation scope (its default): the budget "
        "floor(r·T_a) per (layer, KV-head) holds the generated tokens too, so every decode step "
        "evicts the audio token with the lowest decayed score outside the sinks and the recent "
        "window, and r_GPU (audio kept ÷ audio, the mean over decode steps) falls below r as the "
        "answer grows. γ acts twice: on the prefill score, where it weights the observation "
        f"window's queries (the latest most, γ^(W-1-w); W = {window_text}), and on the score each "
        "decode step adds, which decays the older steps' attention. `voxzip:scope=audio` (WnW "
        "§3.3's audio-only scope) never evicts after prefill, so there γ acts through the prefill "
        "score alone. 'replay recall − γ=1.0' is the change in attention recall that decay buys "
        "at the same budget.",
        f"The last column is VoxZip's own Table 5 on a different model, task and metric "
        f"(Qwen3-Omni-Instruct-30B answering Vox-Infinity questions, accuracy % on the Personal "
        f"Monologues subset, at its {PAPER_BUDGET:.0%} budget); only the two values its text quotes "
        f"are filled. Compare directions (does γ < 1 help at 5%?), never magnitudes.",
    ]
    extra = {"live": live} if live is not None else {}
    return StudyReport(name="voxzip-decay", title="VoxZip Table 5 analogue: temporal decay γ",
                       tables=[("γ sweep: replay and live (kvsim) beside VoxZip's Table 5 (– = not run "
                                "or not quoted).", table)],
                       data=replay, chart=decay_chart(table), notes=notes, extra_data=extra)
