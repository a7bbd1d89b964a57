"""The fidelity study's report: tables with intervals, the figure, and notes whose verdict is
computed from the numbers."""

from __future__ import annotations

import polars as pl

from kvsim.studies.fidelity import ALL_COMPRESSED
from kvsim.studies.fidelity_stats import CLIP
from kvsim.studies.report import StudyReport

#: A rank correlation whose interval stays beyond this magnitude is called reliable.
RELIABLE = 0.5

GENERIC_NOTES = [
    "**What is compared.** Each clip is traced once with the full cache; every policy × budget is "
    "replayed over that trace (open loop: the full cache's queries) and decoded live (closed loop: "
    "the policy's own tokens). A point is one (clip, method, budget). Replay metrics are those of "
    "`kvsim replay` (docs/metrics.md) plus `recall_align` and `output_error_align`, the attention "
    "recall and attention-output error on the clip's aligning layers (the 4 layers whose attention "
    "peak moves most monotonically with the answer, as `kvsim alignment` finds them: their "
    "attention mass sits near the audio being transcribed), and `recall_p10`, the 10th "
    "percentile of the per-step recall.",
    "**Levels.** `per_clip`: rank correlation across methods × budgets within one clip, averaged "
    "over clips (does replay rank methods on one input?). `within_budget`: across the methods of "
    "one budget within one clip, averaged over budgets and clips (does replay pick the better "
    "method at a fixed budget? `r_gpu` is nearly constant there, so this level shows what a "
    "quality metric adds beyond the budget). `pooled`: over every point. "
    "`method_means`: across methods × budgets after averaging each over the clips (does replay "
    "rank the rows of a benchmark table?). Intervals: 95% percentile bootstrap over clips "
    "(seeded), since the methods decoded on one clip share its audio.",
    "**Departure.** The first generated token where a live run differs from the full cache's "
    "tokens on its clip. Up to it the live run and replay saw the same tokens, so replay's "
    "per-step recall before it is directly comparable. `recall_percentile` ranks the departing "
    "step's replay recall among the other compressed runs of the clip that were still on the "
    "full cache's tokens at that same step: 0.5 when recall says nothing about which runs leave, "
    "low when the runs that leave are those whose recall is lowest.",
    "**Predictor.** An isotonic regression of live WER on one replay metric, fitted on all clips "
    "but one and scored on the held-out clip (leave-one-clip-out), against the constant "
    "predictor (the other clips' mean WER). `gain` is the constant's mean absolute error minus "
    "the model's; an interval above 0 is a metric that predicts a new clip's WER.",
]


def _iv(value, low, high) -> str:
    if value is None or value != value:
        return "–"
    return f"{value:+.2f} [{low:+.2f}, {high:+.2f}]"


def correlation_caption_table(corr: pl.DataFrame, target: str) -> pl.DataFrame:
    """Metric × (level, coefficient) cells ``value [low, high]`` for one target."""
    t = corr.filter(pl.col("target") == target)
    rows = []
    for (metric,), g in t.group_by("metric", maintain_order=True):
        row = {"replay metric": metric}
        for r in g.iter_rows(named=True):
            row[f"{r['level']} {'ρ' if r['coefficient'] == 'spearman' else 'τ'}"] = _iv(r["value"], r["low"], r["high"])
        rows.append(row)
    return pl.DataFrame(rows)


#: Budget accounting, not a replay quality measurement: the baseline a quality metric must beat.
BUDGET_METRICS = ("r_gpu", "r_gpu_cpu", "read_fraction")


def best_metric(corr: pl.DataFrame, predictor: pl.DataFrame) -> str:
    """The quality metric (not budget accounting) whose held-out WER predictor gains most over
    the constant; without a predictor, the strongest within-budget Spearman with WER."""
    pred = predictor.filter(~pl.col("metric").is_in(BUDGET_METRICS)) if predictor.height else predictor
    if pred.height:
        return pred.sort("gain", descending=True, nulls_last=True)["metric"][0]
    t = corr.filter((pl.col("target") == "wer") & (pl.col("level") == "within_budget")
                    & (pl.col("coefficient") == "spearman") & ~pl.col("metric").is_in(BUDGET_METRICS))
    return t.sort(pl.col("value").abs(), descending=True, nulls_last=True)["metric"][0]


def verdict(corr: pl.DataFrame, predictor: pl.DataFrame, departure: pl.DataFrame, metric: str) -> str:
    """The plain statement of when replay can stand in for live, from the numbers."""
    def cell(level: str) -> dict:
        return corr.filter((pl.col("metric") == metric) & (pl.col("target") == "wer") & (pl.col("level") == level)
                           & (pl.col("coefficient") == "spearman")).row(0, named=True)

    table, clip, fixed = cell("method_means"), cell("per_clip"), cell("within_budget")
    p = predictor.filter(pl.col("metric") == metric).row(0, named=True) if predictor.height else None
    base = predictor.filter(pl.col("metric") == "r_gpu") if predictor.height else None
    base = base.row(0, named=True) if base is not None and base.height else None
    overall = departure.filter(pl.col("method") == ALL_COMPRESSED).row(0, named=True)

    def reliable(c: dict) -> bool:
        return c["low"] * c["high"] > 0 and min(abs(c["low"]), abs(c["high"])) >= RELIABLE

    def reading(c: dict, yes: str, no: str) -> str:
        if c["value"] != c["value"]:
            return "undefined (live WER or the metric does not vary)"
        return f"{_iv(c['value'], c['low'], c['high'])}: " + (yes if reliable(c) else no)

    parts = [f"**When replay can stand in for live.** The best replay quality metric here is `{metric}` "
             "(largest held-out gain)."]
    parts.append(
        "Ranking the rows of a benchmark table (methods × budgets averaged over clips), its Spearman "
        "correlation with live WER is " + reading(
            table, "replay **can** stand in for live to rank methods and budgets",
            f"replay **cannot** be trusted to rank methods and budgets (the interval does not stay beyond ±{RELIABLE})") + ".")
    parts.append("Within one clip it is " + reading(clip, "per-input rankings hold",
                                                    "per-input rankings are not reliable") + ".")
    parts.append("Among the methods of one budget it is " + reading(
        fixed, "replay picks the better method at a fixed budget",
        "replay does **not** reliably pick the better method at a fixed budget") + ".")
    if p is not None:
        beats = p["gain_low"] > 0
        parts.append(
            f"Predicting a held-out clip's live WER, the isotonic predictor's mean absolute error is "
            f"{p['mae_model']:.3f} against {p['mae_constant']:.3f} for the constant (gain "
            f"{_iv(p['gain'], p['gain_low'], p['gain_high'])}): replay "
            + ("**does** predict a new clip's WER better than the set's mean" if beats else
               "**does not** predict a new clip's WER better than the set's mean") + ".")
    if p is not None and base is not None:
        parts.append(f"The budget alone (`r_gpu`) predicts held-out WER with error {base['mae_model']:.3f}; "
                     + (f"`{metric}` adds to it" if p["mae_model"] < base["mae_model"] else
                        f"`{metric}` does no better than the budget alone") + ".")
    parts.append(
        f"{overall['departed']:.0%} of compressed live runs leave the full cache's tokens, at median token "
        f"{_fmt(overall['median_departure_token'], '.0f')}; after that, replay's queries are no longer "
        f"the live run's, which bounds what any open-loop metric can predict.")
    parts.append(_departure_signal(overall))
    return " ".join(parts)


def _departure_signal(overall: dict) -> str:
    """The sentence on whether replay's per-step recall tells which runs leave, and when."""
    pct, low, high = overall["recall_percentile"], overall["percentile_low"], overall["percentile_high"]
    if pct is None or low is None:
        return "Too few departures to say whether replay's per-step recall tells which runs leave."
    told = high < 0.5
    return (f"At the step a run departs, its replay recall ranks at percentile {pct:.2f} "
            f"[{low:.2f}, {high:.2f}] among the runs still on the full cache's tokens at that step "
            "(0.5: no signal): replay's per-step recall "
            + ("**does** tell which runs are about to leave." if told else "does **not** tell which runs are about to leave."))


def _fmt(v, spec: str) -> str:
    return "–" if v is None or v != v else format(v, spec)


def fidelity_chart(points: pl.DataFrame, metric: str):
    """Live WER against ``metric``, one point per clip × method × budget, coloured by method."""
    import altair as alt

    data = points.select(CLIP, "label", "budget", metric, "wer", "terminated")
    return alt.Chart(data).mark_point(filled=True, opacity=0.7).encode(
        x=alt.X(f"{metric}:Q", title=f"replay {metric}"),
        y=alt.Y("wer:Q", title="live truncated WER (WnW §3.5)"),
        color=alt.Color("label:N", title="method"),
        shape=alt.Shape("budget:N", title="budget"),
        tooltip=[CLIP, "label", "budget", metric, "wer", "terminated"],
    ).properties(title=f"Does replay predict live? live WER vs replay {metric}", width=460, height=320)


def build_report(points: pl.DataFrame, stats: dict[str, pl.DataFrame], extra_notes: list[str]) -> StudyReport:
    """The fidelity report from the joined points and :func:`kvsim.studies.fidelity.analyse`."""
    corr, pred, dep = stats["correlations"], stats["predictor"], stats["departure"]
    metric = best_metric(corr, pred)
    n_clips = points[CLIP].n_unique()
    tables = [
        (f"Rank correlation of each replay metric with live WER ({n_clips} clips, {points.height} "
         "points; value [95% clip-bootstrap interval]):", correlation_caption_table(corr, "wer")),
        ("Rank correlation with live termination (1 = the model stopped by itself):",
         correlation_caption_table(corr, "terminated")),
        ("Leave-one-clip-out predictor of live WER (mean absolute error over held-out clips):", pred),
        ("Where live runs depart from the full cache's tokens, and what replay showed before:", dep),
    ]
    notes = [verdict(corr, pred, dep, metric), *extra_notes, *GENERIC_NOTES]
    data = points.drop([c for c in ("token_ids", "hypothesis") if c in points.columns])
    return StudyReport(name="fidelity", title="Does replay predict live? (kvsim study fidelity)",
                       tables=tables, data=data, chart=fidelity_chart(points, metric), notes=notes,
                       extra_data={"correlations": corr, "predictor": pred, "departure": dep})
