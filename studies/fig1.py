"""WnW §2.1 and Fig. 1: where prefill and decode put their attention over the audio.

For every trace, with the definitions of :mod:`kvsim.studies.mismatch` (prefill = the first
answer token's attention; decode-cumulative = the mean over every answer token; both averaged
over layers and q-heads and normalised over the audio):

* the cumulative attention mass over normalised audio position 0..1 (Fig. 1 (b)), and the mass
  per bin of a uniform grid (Fig. 1 (a)), so that traces of any length share one axis;
* the per-KV-head top-K Jaccard between the two distributions (K = 100, the K of the paper's
  per-head figures) and its distribution over heads;
* the §2.1 summary statistics beside the paper's Voxtral figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from kvsim.studies.mismatch import (
    PAPER_VOXTRAL,
    MismatchStats,
    head_distributions,
    head_jaccard,
    mismatch,
)
from kvsim.studies.report import StudyReport
from kvsim.trace.reader import Trace

#: Bins of the uniform grid over normalised audio position (Fig. 1 (a) plots mass on such a grid).
GRID_BINS = 100
#: K of the per-head top-K Jaccard: WnW §2.1 reports the per-head range at K = 100.
HEAD_K = 100
#: WnW §2.1: the random top-K Jaccard baseline "≈ K/T_a (0.013 at K=100)" on Voxtral.
PAPER_RANDOM_JACCARD_TOP100 = 0.013
#: WnW §2.1: per-head Jaccard "across the 240 heads" (Voxtral-mini-3b: 30 layers x 8 KV-heads).
PAPER_N_HEADS = 240
#: WnW Fig. 1 caption: "averaged across 50 samples from the LibriSpeech-Long dev-clean subset".
PAPER_N_SAMPLES = 50
DISTRIBUTIONS = ("prefill", "decode-cumulative")


@dataclass
class TraceFig1:
    """One trace's Fig. 1 measurements."""

    name: str
    n_audio: int
    stats: MismatchStats
    curves: pl.DataFrame  #: trace, distribution, position, mass, cumulative
    heads: pl.DataFrame  #: trace, layer, kv_head, jaccard


def cumulative_on_grid(p: np.ndarray, bins: int = GRID_BINS) -> tuple[np.ndarray, np.ndarray]:
    """The cumulative mass of the distribution ``p`` (T_a,) at ``bins + 1`` evenly spaced
    normalised positions 0, 1/bins, ..., 1.

    Token ``i`` covers ``[i/T_a, (i+1)/T_a)`` of the axis with its mass spread evenly over it, so
    the curve is piecewise linear, non-decreasing, 0 at 0 and exactly 1 at 1.
    """
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 1 or len(p) == 0 or (p < 0).any() or p.sum() <= 0:
        raise ValueError("a distribution must be a non-empty 1-D array of non-negative mass")
    cum = np.concatenate([[0.0], np.cumsum(p)])
    cum /= cum[-1]
    x = np.linspace(0.0, 1.0, bins + 1)
    return x, np.interp(x * len(p), np.arange(len(p) + 1), cum)


def _curves(name: str, pre: np.ndarray, dec: np.ndarray) -> pl.DataFrame:
    frames = []
    for label, p in zip(DISTRIBUTIONS, (pre, dec), strict=True):
        x, cum = cumulative_on_grid(p)
        frames.append(pl.DataFrame({
            "trace": name, "distribution": label, "position": x,
            "mass": np.concatenate([[0.0], np.diff(cum)]), "cumulative": cum,
        }))
    return pl.concat(frames)


def measure_trace(trace: Trace) -> TraceFig1:
    """Fig. 1 curves, per-head Jaccard and §2.1 statistics of one trace (one attention pass)."""
    pre_h, dec_h = head_distributions(trace)
    jac = head_jaccard(pre_h, dec_h, HEAD_K)
    layer, kv = np.indices(jac.shape)
    heads = pl.DataFrame({"trace": trace.name, "layer": layer.ravel(), "kv_head": kv.ravel(),
                          "jaccard": jac.ravel()})
    return TraceFig1(name=trace.name, n_audio=trace.n_audio,
                     stats=mismatch(trace, (pre_h, dec_h)),
                     curves=_curves(trace.name, pre_h.mean((0, 1)), dec_h.mean((0, 1))), heads=heads)


#: (MismatchStats field or per-head statistic, row label) of the summary table.
SUMMARY_ROWS = [
    ("prefill_first10", "prefill mass, first 10% of audio"),
    ("prefill_first_half", "prefill mass, first half"),
    ("decode_first10", "decode-cumulative mass, first 10% of audio"),
    ("decode_first_half", "decode-cumulative mass, first half"),
    ("prefill_first10_speech", "prefill mass, first 10% of speech (from the first word)"),
    ("decode_first10_speech", "decode-cumulative mass, first 10% of speech"),
    ("jaccard_top100", "top-100 Jaccard, prefill vs decode"),
    ("jaccard_top500", "top-500 Jaccard"),
    ("random_jaccard_top100", "top-100 Jaccard of two random sets (kvsim K/(2T_a-K); paper ≈ K/T_a)"),
    ("head_jaccard_min", "per-KV-head top-100 Jaccard, min"),
    ("head_jaccard_median", "per-KV-head top-100 Jaccard, median"),
    ("head_jaccard_max", "per-KV-head top-100 Jaccard, max"),
    ("head_jaccard_below_01", "share of KV-heads with Jaccard < 0.1"),
]


def _paper(key: str) -> float | None:
    if key == "random_jaccard_top100":
        return PAPER_RANDOM_JACCARD_TOP100
    return PAPER_VOXTRAL.get(key)


def summary_table(results: Sequence[TraceFig1]) -> pl.DataFrame:
    """One row per statistic: the paper's Voxtral figure, then one column per trace."""
    cols: dict[str, list] = {"statistic": [label for _, label in SUMMARY_ROWS],
                             "WnW paper (Voxtral, LibriSpeech-Long)": [_paper(k) for k, _ in SUMMARY_ROWS]}
    for r in results:
        values = {**r.stats.as_dict(), "head_jaccard_median": float(r.heads["jaccard"].median())}
        cols[f"kvsim: {r.name}"] = [float(values[k]) for k, _ in SUMMARY_ROWS]
    return pl.DataFrame(cols, schema_overrides={c: pl.Float64 for c in cols if c != "statistic"})


def traces_table(results: Sequence[TraceFig1], traces: Sequence[Trace]) -> pl.DataFrame:
    """What each trace is: model, audio tokens, answer tokens, KV-heads (the paper's row first)."""
    rows = [{"trace": f"WnW paper ({PAPER_N_SAMPLES} clips, mean)", "model": "Voxtral-mini-3b",
             "audio tokens T_a": "not stated", "answer tokens": "–",
             "KV-heads": str(PAPER_N_HEADS)}]
    for r, t in zip(results, traces, strict=True):
        rows.append({"trace": r.name, "model": t.meta.model.name, "audio tokens T_a": str(r.n_audio),
                     "answer tokens": str(t.meta.n_positions - t.meta.n_prefill + 1),
                     "KV-heads": str(r.heads.height)})
    return pl.DataFrame(rows)


def jaccard_histogram(heads: pl.DataFrame, step: float = 0.05) -> pl.DataFrame:
    """Per trace, KV-heads per Jaccard bin ``[lo, hi)`` (the last bin closed at 1)."""
    n_bins = int(round(1 / step))
    idx = (pl.col("jaccard") / step).floor().cast(pl.Int64).clip(0, n_bins - 1)
    return (heads.group_by("trace", idx.alias("bin"), maintain_order=True).agg(pl.len().alias("heads"))
            .with_columns(jaccard_lo=pl.col("bin") * step, jaccard_hi=(pl.col("bin") + 1) * step)
            .sort("trace", "bin"))


def fig1_chart(curves: pl.DataFrame, heads: pl.DataFrame):
    """Cumulative mass curves per trace (one facet each, the uniform distribution dashed) above
    a histogram of per-KV-head Jaccard per trace (the 0.1 line the paper counts heads below)."""
    import altair as alt

    diagonal = alt.Chart(pl.DataFrame({"position": [0.0, 1.0], "cumulative": [0.0, 1.0]})).mark_line(
        strokeDash=[4, 4], color="gray").encode(x="position:Q", y="cumulative:Q")
    lines = alt.Chart().mark_line().encode(
        x=alt.X("position:Q", title="normalised audio position"),
        y=alt.Y("cumulative:Q", title="cumulative attention mass"),
        color=alt.Color("distribution:N", sort=list(DISTRIBUTIONS), title=None),
    )
    facets = alt.layer(lines, diagonal, data=curves).properties(width=220, height=200).facet(
        facet=alt.Facet("trace:N", title=None), columns=3,
        title="WnW Fig. 1 (b): prefill vs decode-cumulative attention over the audio")
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("jaccard_lo:Q", scale=alt.Scale(domain=[0, 1]), title=f"per-KV-head top-{HEAD_K} Jaccard"),
        x2="jaccard_hi:Q", y=alt.Y("heads:Q", title="KV-heads"), y2=alt.datum(0),
    )
    rule = alt.Chart().mark_rule(strokeDash=[2, 2], color="red").encode(x=alt.datum(0.1))
    below = alt.layer(bars, rule, data=jaccard_histogram(heads)).properties(width=220, height=120).facet(
        facet=alt.Facet("trace:N", title=None), columns=3,
        title="Per-KV-head Jaccard, prefill vs decode (WnW §2.1: 0.006–0.641 over 240 heads, 27% < 0.1)")
    return alt.vconcat(facets, below).resolve_scale(color="independent")


def fig1_report(traces: Sequence[Trace]) -> StudyReport:
    """Measure every trace and build the study's report (tables, figure, data, notes)."""
    results = [measure_trace(t) for t in traces]
    curves = pl.concat([r.curves for r in results])
    heads = pl.concat([r.heads for r in results])
    stats = pl.DataFrame([{"trace": r.name, **r.stats.as_dict()} for r in results])
    notes = [
        "Prefill: the attention of the first answer token (the prompt's last query) over the audio; "
        "decode-cumulative: the mean over every answer token (that query and every decode step); both "
        "averaged over layers and q-heads and normalised over the audio (WnW §2.1). Curves: the "
        "cumulative mass at 101 evenly spaced normalised positions (each token's mass spread over its "
        "1/T_a of the axis); the dashed diagonal is uniform attention.",
        f"Per-head Jaccard: the top-{HEAD_K} audio positions of each KV-head's prefill and "
        f"decode-cumulative distributions (its q-heads averaged), K = {HEAD_K} as in the paper's "
        "per-head figures. K is not scaled with the audio length: on a short trace top-100 covers much "
        "of the audio and the Jaccard is high by construction (compare the random-set row).",
        "The paper averages the distributions of 50 LibriSpeech-Long dev-clean clips on Voxtral-mini-3b; "
        "each kvsim column is one trace (a synth trace is the synthetic generator, not a model). "
        "'Of speech' starts at the first word's onset (trace word timings; – when the trace has none).",
    ]
    return StudyReport(
        name="fig1", title="WnW §2.1 / Fig. 1: prefill vs decode attention over the audio",
        tables=[("Traces measured.", traces_table(results, traces)),
                ("WnW §2.1 statistics: the paper's Voxtral figures beside kvsim's (– = not reported).",
                 summary_table(results))],
        data=curves, chart=fig1_chart(curves, heads), notes=notes,
        extra_data={"heads": heads, "stats": stats},
    )
