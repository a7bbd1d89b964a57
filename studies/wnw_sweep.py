"""WnW's hyperparameter studies (WnW §3.8, Table 3; App. C, Table 7): every setting of a
sweep replayed over traces (attention recall, output error, r_GPU, r_GPU+CPU) and decoded
live (truncated WER, termination), beside the paper's WER.

Head counts
    The paper's ``n_voice`` and ``n_anchor`` are counts of Voxtral-mini-3b's
    ``L × H_kv = 240`` KV-heads (WnW §3.4). A model with another head count gets the same
    share, ``max(1, round(n · L·H_kv / 240))`` (minivox, 90 heads: n_voice 30 -> 11,
    n_anchor 5 -> 2); the tables show both values.
λ
    WnW §3.8 A1 retunes "λ per cell so the on-GPU footprint matches the target" (and §3.4
    selects λ on a calibration set): with calibration traces, λ is fitted per setting ×
    budget on them (:func:`kvsim.policies.wnw_calibrate.fit_lambda`) and passed to replay
    and live alike; without, WnW fits λ on each input itself (its per-input fallback) and
    the report says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from kvsim.policies._wnw_layout import ANCHOR, TIDAL
from kvsim.policies.base import HeadScores, PolicyContext
from kvsim.policies.spec import PolicySpec
from kvsim.policies.wnw_calibrate import fit_lambda
from kvsim.studies.wnw_lambda import CalibrationSet, calibration_contexts

#: WnW §3.4: Voxtral-mini-3b has "L×H_kv = 240" KV-heads; the paper's head counts are of these.
PAPER_KV_HEADS = 240

#: The per-input λ warning of WnW (no ``lam`` given): collected once into the report's notes.
PER_INPUT_LAMBDA = "no lam given"


def scale_heads(n_paper: int, n_heads: int) -> int:
    """The paper's head count ``n_paper`` (of 240) as the same share of ``n_heads``, >= 1."""
    return max(1, int(round(n_paper * n_heads / PAPER_KV_HEADS)))


@dataclass(frozen=True)
class Setting:
    """One cell of a sweep: WnW at ``budget`` with ``params`` (kvsim's values).

    ``group`` names the sweep (a table of the report), ``value`` is the setting as the paper
    writes it, ``paper_wer`` the paper's truncated WER (None where the paper has none).
    """

    group: str
    value: str
    budget: float
    params: tuple[tuple[str, Any], ...]
    paper_wer: float | None = None

    @property
    def key(self) -> tuple[tuple[tuple[str, Any], ...], float]:
        """What makes two settings the same run (the same WnW at the same budget)."""
        return self.params, self.budget

    def spec(self, lam: float | None = None) -> PolicySpec:
        """The WnW spec of this setting, with ``lam`` when one was fitted."""
        params = dict(self.params)
        if lam is not None:
            params["lam"] = float(lam)
        return PolicySpec("wnw", self.budget, params)

    @property
    def kvsim_value(self) -> str:
        """kvsim's hyperparameters of this setting, ``key=value`` (``default`` if none)."""
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in self.params) or "default"


def extremes(settings: Sequence[Setting]) -> list[Setting]:
    """The first and last setting of every group (``--quick``), in order."""
    groups: dict[str, list[Setting]] = {}
    for s in settings:
        groups.setdefault(s.group, []).append(s)
    return [s for g in groups.values() for s in dict.fromkeys([g[0], g[-1]])]


def unique_runs(settings: Sequence[Setting]) -> list[Setting]:
    """One setting per distinct (params, budget): groups share a run where they coincide."""
    return list({s.key: s for s in reversed(settings)}.values())[::-1]


# ----------------------------------------------------------------------------- λ
def fit_lambdas(settings: Sequence[Setting],
                contexts: CalibrationSet | Sequence[PolicyContext] | None,
                ray: str | None = None) -> dict:
    """λ per distinct setting fitted on ``contexts`` (WnW §3.8 A1, §3.4: a
    :class:`CalibrationSet` under its fit, one Ray task per setting with ``ray``; plain
    contexts under the prefill fit); ``{}`` without contexts (each input then fits its own λ)."""
    if not contexts:
        return {}
    if isinstance(contexts, CalibrationSet):
        runs = unique_runs(settings)
        lams = contexts.lams([(s.budget, dict(s.params)) for s in runs], ray)
        return {s.key: lam for s, lam in zip(runs, lams, strict=True)}
    return {s.key: fit_lambda(contexts, s.budget, **dict(s.params)) for s in unique_runs(settings)}


class CollectedWarnings:
    """WnW's warnings raised inside a ``with`` block, kept once each (for the report's notes)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def __enter__(self) -> CollectedWarnings:
        self._ctx = warnings.catch_warnings(record=True)
        self._log = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        for w in self._log:
            text = str(w.message)
            if text.startswith("wnw") and text not in self.messages:
                self.messages.append(text)

    @property
    def per_input_lambda(self) -> bool:
        return any(PER_INPUT_LAMBDA in m for m in self.messages)

    def others(self) -> list[str]:
        """The warnings other than the per-input λ one (anchors reduced to fit, ...)."""
        return [m for m in self.messages if PER_INPUT_LAMBDA not in m]


# ----------------------------------------------------------------------------- replay
REPLAY_METRICS = ("attn_recall", "output_error", "r_gpu", "r_gpu_cpu")


def replay_settings(settings: Sequence[Setting], lams: dict, traces: Sequence[Path],
                    scores: HeadScores | None, max_steps: int | None = None,
                    log: Callable[[str], None] = print) -> pl.DataFrame:
    """Replay every distinct setting over every trace: one row per (trace, setting key) with
    :data:`REPLAY_METRICS`, the prefill r_GPU, the heads WnW made anchors (flat L·H_kv
    indices) and how many it made tidal, and its λ."""
    from kvsim.replay.engine import ReplayConfig, Replayer
    from kvsim.trace.reader import Trace

    runs = unique_runs(settings)
    specs = [s.spec(lams.get(s.key)) for s in runs]
    cfg = ReplayConfig(head_scores=scores, max_steps=max_steps)
    rows = []
    for path in traces:
        log(f"replaying {path} ({len(specs)} WnW settings)")
        rep = Replayer(Trace(path), cfg)
        results = rep.run(specs)
        if rep.failures:
            spec, msg = rep.failures[0]
            raise ValueError(f"{path}: {spec.label}@{spec.budget:g}: {msg}")
        for s, res in zip(runs, results, strict=True):
            roles = res.policy.roles_
            rows.append({"trace": res.trace, "params": s.kvsim_value, "budget": s.budget,
                         **{m: float(res.summary[m]) for m in REPLAY_METRICS},
                         "r_gpu_prefill": float(res.summary["r_gpu_prefill"]),
                         "anchor_heads": ",".join(map(str, np.flatnonzero(roles == ANCHOR))),
                         "anchors": int(np.sum(roles == ANCHOR)),
                         "tidal": int(np.sum(roles == TIDAL)),
                         "lam": float(res.policy.lambda_solved_),
                         "lam_source": res.policy.lam_source_})
    return pl.DataFrame(rows)


def replay_means(frame: pl.DataFrame) -> pl.DataFrame:
    """Replay metrics and λ averaged over traces, one row per (params, budget); the head
    counts are the largest over traces (one heads.json gives every trace the same roles)."""
    return frame.group_by(["params", "budget"], maintain_order=True).agg(
        *(pl.col(m).mean() for m in (*REPLAY_METRICS, "lam")),
        pl.col("anchors").max(), pl.col("tidal").max(), pl.len().alias("traces"))


# ----------------------------------------------------------------------------- live
def live_settings(settings: Sequence[Setting], lams: dict, items: Sequence, cfg: Any, out: Path,
                  grid: Any, log: Callable[[str], None] = print,
                  **job_args: Any) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Decode every distinct setting on every input through
    :func:`kvsim.studies.live_grid.live_grid` (a ``kvsim live`` run folder ``out``).

    Returns
    -------
    (aggregate, runs): one row per (params, budget) with the truncated WER of the set,
    termination rate, measured r_GPU and r_GPU+CPU and inputs; and every live run (one row per
    input and setting, its ``params`` column added), for comparisons paired by clip.
    """
    from kvsim.live.run import PlanItem, aggregate
    from kvsim.studies.live_grid import live_grid

    runs = unique_runs(settings)
    plan = [PlanItem("none", s.spec(lams.get(s.key))) for s in runs]
    frame = live_grid(items, plan, cfg, out, grid, log=log, **job_args)
    if frame is None or frame.is_empty():
        raise ValueError(f"{out}: the live grid produced no runs")
    keys = ["label", "budget"]
    names = pl.DataFrame({"label": [p.spec.label for p in plan], "budget": [p.spec.budget for p in plan],
                          "params": [s.kvsim_value for s in runs]},
                         schema={"label": pl.String, "budget": pl.Float64, "params": pl.String})
    agg = aggregate(frame)
    wer = pl.col("wer") if "wer" in agg.columns else pl.lit(None, dtype=pl.Float64)
    summary = agg.join(names, on=keys, how="inner", maintain_order="left").select(
        "params", "budget", wer.alias("live_wer"), pl.col("termination_rate").alias("termination"),
        pl.col("r_gpu").alias("live_r_gpu"), pl.col("r_gpu_cpu").alias("live_r_gpu_cpu"), "inputs")
    return summary, frame.join(names, on=keys, how="left", maintain_order="left")


# ----------------------------------------------------------------------------- table
def settings_frame(settings: Sequence[Setting]) -> pl.DataFrame:
    """One row per setting: group, the paper's value and WER, kvsim's hyperparameters."""
    return pl.DataFrame([{"group": s.group, "setting": s.value, "budget": s.budget,
                          "params": s.kvsim_value, "paper_wer": s.paper_wer} for s in settings],
                        schema={"group": pl.String, "setting": pl.String, "budget": pl.Float64,
                                "params": pl.String, "paper_wer": pl.Float64})


def study_data(settings: Sequence[Setting], replay: pl.DataFrame | None,
               live: pl.DataFrame | None) -> pl.DataFrame:
    """Every setting with its replay means (over traces) and live aggregate joined in."""
    data = settings_frame(settings)
    if replay is not None:
        data = data.join(replay_means(replay), on=["params", "budget"], how="left")
    if live is not None:
        data = data.join(live, on=["params", "budget"], how="left")
    return data


#: The markdown columns: (data column, header); a column absent from the data is left out.
TABLE_COLUMNS = (("setting", "setting (paper)"), ("params", "kvsim WnW"),
                 ("paper_wer", "paper WER %"), ("tidal", "tidal heads"), ("lam", "λ"),
                 ("attn_recall", "replay recall"), ("output_error", "replay out err"),
                 ("r_gpu", "replay r_GPU"), ("r_gpu_cpu", "replay r_GPU+CPU"),
                 ("live_wer", "live WER %"), ("termination", "live terminated"),
                 ("live_r_gpu", "live r_GPU"))


def group_tables(data: pl.DataFrame, captions: dict[str, str]) -> list[tuple[str, pl.DataFrame]]:
    """One markdown table per group of ``data``, captioned by ``captions[group]``."""
    tables = []
    for group in dict.fromkeys(data["group"].to_list()):
        rows = data.filter(pl.col("group") == group)
        if "live_wer" in rows.columns:
            rows = rows.with_columns(pl.col("live_wer") * 100)
        cols = [(c, h) for c, h in TABLE_COLUMNS if c in rows.columns]
        if rows["paper_wer"].is_null().all():
            cols = [(c, h) for c, h in cols if c != "paper_wer"]
        tables.append((captions.get(group, group),
                       rows.select([pl.col(c).alias(h) for c, h in cols])))
    return tables


# ----------------------------------------------------------------------------- the study
@dataclass
class SweepOptions:
    """What a WnW sweep study runs on (the ``kvsim study table3/table7`` options).

    ``traces``: replayed (none: no replay part); ``heads``: the heads.json of the model;
    ``calibration_traces``: λ is fitted on these (none: per-input λ); ``live_out``: the live
    run folder, None for no live part; ``split``/``limit``: the live inputs of the manifest
    under ``dataset_root``.
    """

    traces: Sequence[Path]
    heads: Path | None
    calibration_traces: Sequence[Path] = ()
    live_out: Path | None = None
    dataset_root: Path = Path("data/minivox")
    split: str = "test_30_60"
    limit: int | None = 8
    max_new_tokens: int = 300
    grid: Any = None  #: a :class:`kvsim.studies.live_grid.GridSpec`
    max_steps: int | None = None
    lambda_fit: str = "measured"  #: λ fit on the calibration traces: measured (§3.4) | prefill


def run_sweep(settings: Sequence[Setting], opts: SweepOptions,
              log: Callable[[str], None] = print) -> tuple[pl.DataFrame, list[str], dict]:
    """Replay and decode ``settings``; returns (the study's data, notes on how λ was chosen
    and on what WnW warned, extra frames: the per-trace replay rows, ``replay``, and every
    live run, ``runs``)."""
    from kvsim.trace.heads import read_heads

    scores = read_heads(opts.heads) if opts.heads else None
    calib = (calibration_contexts(opts.calibration_traces, scores, opts.lambda_fit)
             if opts.calibration_traces else None)
    replay = live = live_runs = None
    with CollectedWarnings() as caught:
        lams = fit_lambdas(settings, calib, opts.grid.ray if opts.grid is not None else None)
        if opts.traces:
            replay = replay_settings(settings, lams, opts.traces, scores, opts.max_steps, log)
        if opts.live_out is not None:
            live, live_runs = _live(settings, lams, opts, scores, log)
    notes = [_lambda_note(opts, lams, caught)]
    notes += [f"WnW warned: {m}" for m in caught.others()]
    extra = {name: frame for name, frame in (("replay", replay), ("runs", live_runs))
             if frame is not None}
    return study_data(settings, replay, live), notes, extra


def sweep_report(name: str, titles: tuple[str, str], settings: Sequence[Setting],
                 captions: dict[str, str], intro: str, opts: SweepOptions, quick: bool = False,
                 log: Callable[[str], None] = print):
    """Run a WnW sweep study's ``settings`` (``quick``: the first and last of each group) and
    build its report: one table per group (``captions``), the chart, ``intro`` and the notes
    of :func:`run_sweep`; ``titles``: the report's and the chart's."""
    from kvsim.studies.report import StudyReport

    if quick:
        settings = extremes(settings)
    data, notes, extra = run_sweep(settings, opts, log)
    return StudyReport(name=name, title=titles[0], tables=group_tables(data, captions), data=data,
                       chart=sweep_chart(data, titles[1]), notes=[intro, *notes], extra_data=extra)


def _live(settings: Sequence[Setting], lams: dict, opts: SweepOptions, scores: HeadScores | None,
          log: Callable[[str], None]) -> tuple[pl.DataFrame, pl.DataFrame]:
    from kvsim.live.data import load_dataset
    from kvsim.live.decode import LiveConfig

    items = load_dataset("manifest", opts.dataset_root, split=opts.split, limit=opts.limit)
    cfg = LiveConfig(max_new_tokens=opts.max_new_tokens, head_scores=scores)
    return live_settings(settings, lams, items, cfg, opts.live_out, opts.grid, log)


def _lambda_note(opts: SweepOptions, lams: dict, caught: CollectedWarnings) -> str:
    if lams:
        names = ", ".join(Path(p).name for p in opts.calibration_traces)
        return (f"λ: fitted per setting × r_GPU on {len(opts.calibration_traces)} calibration "
                f"trace(s) ({names}) as the largest λ whose mean {opts.lambda_fit} r_GPU is at "
                "most the target (WnW §3.4, §3.8 A1); column λ.")
    said = " (WnW warned so)" if caught.per_input_lambda else ""
    return ("λ: no calibration traces given, so WnW fitted λ on each input itself (its "
            f"per-input λ, not the paper's calibration-set λ){said}; column λ is the mean over "
            "the replayed traces. Pass --calibration-traces for the paper's protocol.")


def sweep_chart(data: pl.DataFrame, title: str):
    """Replay recall, replay output error, live WER and the paper's WER (fractions) per
    setting, one panel per group."""
    import altair as alt

    metrics = {"attn_recall": "replay recall", "output_error": "replay output error",
               "live_wer": "live WER", "paper_wer": "paper WER"}
    frame = data.with_row_index("order").with_columns(pl.col("paper_wer") / 100)
    present = [c for c in metrics if c in frame.columns]
    long = frame.unpivot(index=["order", "group", "setting"], on=present,
                         variable_name="metric", value_name="value").drop_nulls("value")
    long = long.with_columns(pl.col("metric").replace_strict(metrics))
    return alt.Chart(long).mark_line(point=True).encode(
        x=alt.X("setting:N", sort=alt.SortField("order"), title=None),
        y=alt.Y("value:Q", title="fraction"),
        color=alt.Color("metric:N"),
        tooltip=["group", "setting", "metric", alt.Tooltip("value:Q", format=".3f")],
    ).properties(width=180, height=160).facet(
        facet=alt.Facet("group:N", sort=list(dict.fromkeys(data["group"].to_list())), title=None),
        columns=3).resolve_scale(x="independent").properties(title=title)
