"""Statistics of the fidelity study: how well a replay metric ranks live quality, with clip
bootstrap intervals; a leave-one-clip-out predictor of live WER; where a live run departs from
the full cache's tokens.

Every function takes a long frame with one row per (clip, method, budget): a ``clip`` column,
the method keys (``label``, ``budget``), replay metric columns and live target columns. The
unit of resampling is the clip: methods decoded on one clip share its audio, so their errors
are not independent, while clips are.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import polars as pl
from scipy import stats
from scipy.optimize import isotonic_regression

CLIP = "clip"
METHOD_KEYS = ("label", "budget")
#: How the (clip, method, budget) points are pooled before ranking.
LEVELS = ("per_clip", "within_budget", "pooled", "method_means")
COEFFICIENTS = ("spearman", "kendall")


@dataclass(frozen=True)
class Interval:
    """A statistic and its bootstrap percentile interval (NaN where undefined)."""

    value: float
    low: float
    high: float


def rank_correlation(x: np.ndarray, y: np.ndarray, coefficient: str = "spearman") -> float:
    """Spearman's rho or Kendall's tau-b of ``x`` and ``y``; NaN when either is constant or
    fewer than 3 points are finite."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    if coefficient == "spearman":  # Pearson of the mid-ranks (= scipy.stats.spearmanr, faster)
        return float(np.corrcoef(stats.rankdata(x), stats.rankdata(y))[0, 1])
    if coefficient == "kendall":
        return float(stats.kendalltau(x, y)[0])
    raise ValueError(f"coefficient must be one of {', '.join(COEFFICIENTS)}, got {coefficient!r}")


def clip_matrix(frame: pl.DataFrame, column: str) -> np.ndarray:
    """``column`` as a (clips, methods) float array, clips and methods in order of first
    appearance; NaN where a clip lacks a method."""
    keyed = frame.with_columns(pl.concat_str([pl.col(k).cast(pl.Utf8) for k in METHOD_KEYS],
                                             separator="@").alias("_method"))
    clips = keyed[CLIP].unique(maintain_order=True).to_list()
    methods = keyed["_method"].unique(maintain_order=True).to_list()
    out = np.full((len(clips), len(methods)), np.nan)
    ci = {c: i for i, c in enumerate(clips)}
    mi = {m: i for i, m in enumerate(methods)}
    values = keyed[column].cast(pl.Float64).to_numpy()
    for c, m, v in zip(keyed[CLIP].to_list(), keyed["_method"].to_list(), values, strict=True):
        out[ci[c], mi[m]] = v
    return out


def budget_groups(frame: pl.DataFrame) -> np.ndarray:
    """The budget index of every column of :func:`clip_matrix` (same column order)."""
    methods = frame.select(*METHOD_KEYS).unique(maintain_order=True)
    budgets = methods["budget"].to_numpy()
    return np.unique(budgets, return_inverse=True)[1]


def level_correlation(metric: np.ndarray, target: np.ndarray, level: str, coefficient: str = "spearman",
                      clips: np.ndarray | None = None, groups: np.ndarray | None = None) -> float:
    """Rank correlation of a (clips, methods) ``metric`` with ``target`` at one pooling
    ``level``, over the rows ``clips`` (all by default; a bootstrap draw repeats some).

    ``per_clip``: across methods × budgets within each clip, then the mean over clips (the
    question a researcher asks of one input); ``pooled``: over every (clip, method, budget)
    point; ``method_means``: across methods × budgets after averaging each over the clips
    (the question of a benchmark table); ``within_budget``: across the methods of one budget
    (``groups``: the budget index of every column) within one clip, averaged over budgets and
    clips (does replay pick the better method at a fixed budget, beyond the budget itself?).
    """
    rows = np.arange(len(metric)) if clips is None else clips
    if level in ("per_clip", "within_budget"):
        by = groups if level == "within_budget" else None
        return _finite_mean(per_clip_correlations(metric, target, coefficient, by)[rows])
    m, t = metric[rows], target[rows]
    if level == "pooled":
        return rank_correlation(m.ravel(), t.ravel(), coefficient)
    if level == "method_means":
        with warnings.catch_warnings():  # a method no drawn clip has: NaN, left out
            warnings.simplefilter("ignore", RuntimeWarning)
            return rank_correlation(np.nanmean(m, 0), np.nanmean(t, 0), coefficient)
    raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")


def per_clip_correlations(metric: np.ndarray, target: np.ndarray, coefficient: str = "spearman",
                          groups: np.ndarray | None = None) -> np.ndarray:
    """(clips,) rank correlation across methods within each clip (NaN where undefined); with
    ``groups`` (a group index per column), the mean of the correlations within each group."""
    if groups is None:
        return np.array([rank_correlation(a, b, coefficient) for a, b in zip(metric, target, strict=True)])
    per_group = [per_clip_correlations(metric[:, groups == g], target[:, groups == g], coefficient)
                 for g in np.unique(groups)]
    return np.array([_finite_mean(np.array(v)) for v in zip(*per_group, strict=True)])


def _finite_mean(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    return float(values.mean()) if len(values) else float("nan")


def bootstrap_draws(n_clips: int, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """(n_boot, n_clips) clip indices drawn with replacement (seeded); the same draws serve
    every statistic of a study, so their intervals are comparable."""
    return np.random.default_rng(seed).integers(0, n_clips, size=(n_boot, n_clips))


def bootstrap(statistic: Callable[[np.ndarray], float], n_clips: int, draws: np.ndarray,
              level: float = 0.95) -> Interval:
    """``statistic(clip_rows)`` on every clip and its percentile interval over ``draws``
    (draws where it is undefined are left out)."""
    value = statistic(np.arange(n_clips))
    values = np.array([statistic(d) for d in draws])
    values = values[np.isfinite(values)]
    if not len(values):
        return Interval(value, float("nan"), float("nan"))
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(value, float(low), float(high))


def correlation_interval(metric: np.ndarray, target: np.ndarray, level: str, coefficient: str,
                         draws: np.ndarray, groups: np.ndarray | None = None) -> Interval:
    """:func:`level_correlation` with its interval over the clip ``draws`` (the per-clip
    correlations are computed once: a draw only reweights them)."""
    if level in ("per_clip", "within_budget"):
        per_clip = per_clip_correlations(metric, target, coefficient, groups if level == "within_budget" else None)
        return bootstrap(lambda d: _finite_mean(per_clip[d]), len(metric), draws)
    stat = partial(level_correlation, metric, target, level, coefficient)
    return bootstrap(lambda d: stat(d), len(metric), draws)


def correlation_table(frame: pl.DataFrame, metrics: Sequence[str], targets: Sequence[str],
                      n_boot: int = 1000, seed: int = 0) -> pl.DataFrame:
    """One row per (metric, target, level, coefficient): the correlation and its clip
    bootstrap 95% interval. Metrics absent or without a finite value are left out."""
    n_clips = frame[CLIP].n_unique()
    draws = bootstrap_draws(n_clips, n_boot, seed)
    groups = budget_groups(frame)
    rows = []
    for metric in metrics:
        if metric not in frame.columns or not np.isfinite(frame[metric].cast(pl.Float64).to_numpy()).any():
            continue
        m = clip_matrix(frame, metric)
        for target in targets:
            t = clip_matrix(frame, target)
            for level in LEVELS:
                for coef in COEFFICIENTS:
                    iv = correlation_interval(m, t, level, coef, draws, groups)
                    rows.append({"metric": metric, "target": target, "level": level,
                                 "coefficient": coef, "value": iv.value, "low": iv.low, "high": iv.high})
    return pl.DataFrame(rows)


# ----------------------------------------------------------------------------- predictor
def isotonic_predictor(x: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A monotone fit of ``y`` on ``x``: isotonic regression (ties averaged), increasing or
    decreasing as the training points' Spearman sign says; predictions interpolate linearly
    between the fitted knots and stay constant beyond them."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if not len(x):
        raise ValueError("no finite training point")
    rho = rank_correlation(x, y)
    knots, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, y) / counts
    fit = isotonic_regression(means, weights=counts.astype(np.float64), increasing=not rho < 0).x
    return lambda q: np.interp(np.asarray(q, dtype=np.float64), knots, fit)


def leave_one_clip_out(frame: pl.DataFrame, metric: str, target: str) -> pl.DataFrame:
    """Held-out absolute error per clip: the isotonic predictor of ``target`` from ``metric``
    fitted on every other clip, against the constant predictor (the other clips' mean).
    One row per clip with a finite point: ``clip``, ``n``, ``mae_model``, ``mae_constant``."""
    data = frame.select(CLIP, pl.col(metric).cast(pl.Float64), pl.col(target).cast(pl.Float64))
    data = data.filter(pl.col(metric).is_finite() & pl.col(target).is_finite())
    rows = []
    for clip in data[CLIP].unique(maintain_order=True).to_list():
        train, test = data.filter(pl.col(CLIP) != clip), data.filter(pl.col(CLIP) == clip)
        if not train.height:
            continue
        truth = test[target].to_numpy()
        model = isotonic_predictor(train[metric].to_numpy(), train[target].to_numpy())
        rows.append({CLIP: clip, "n": test.height,
                     "mae_model": float(np.abs(model(test[metric].to_numpy()) - truth).mean()),
                     "mae_constant": float(np.abs(train[target].mean() - truth).mean())})
    return pl.DataFrame(rows, schema={CLIP: pl.Utf8, "n": pl.Int64, "mae_model": pl.Float64,
                                      "mae_constant": pl.Float64})


def predictor_table(frame: pl.DataFrame, metrics: Sequence[str], target: str = "wer",
                    n_boot: int = 1000, seed: int = 0) -> pl.DataFrame:
    """Leave-one-clip-out held-out error of every metric's predictor, mean over clips, and the
    gain over the constant predictor (``mae_constant - mae_model``) with its clip bootstrap
    95% interval: a gain whose interval excludes 0 is a metric that predicts."""
    rows = []
    for metric in metrics:
        if metric not in frame.columns:
            continue
        per_clip = leave_one_clip_out(frame, metric, target)
        if per_clip.height < 2:
            continue
        model, const = per_clip["mae_model"].to_numpy(), per_clip["mae_constant"].to_numpy()
        draws = bootstrap_draws(len(model), n_boot, seed)
        gain = bootstrap(lambda d, m=model, c=const: float((c[d] - m[d]).mean()), len(model), draws)
        rows.append({"metric": metric, "target": target, "clips": per_clip.height,
                     "mae_model": float(model.mean()), "mae_constant": float(const.mean()),
                     "gain": gain.value, "gain_low": gain.low, "gain_high": gain.high})
    return pl.DataFrame(rows)


# ----------------------------------------------------------------------------- departure
def departure_index(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first generated token of ``tokens`` that differs from ``reference`` (the
    full cache's tokens on the same clip); the shorter length when one is a prefix of the
    other; None when they are equal."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def text_departure(hypothesis: str, prefixes: Sequence[str]) -> int | None:
    """:func:`departure_index` recovered from text, for live runs that kept no token ids:
    ``prefixes[k]`` is the decoded text of the reference's first ``k`` tokens; the departure
    is the last ``k`` before the first prefix that does not start ``hypothesis``, None when
    the hypothesis is the whole reference text. A prefix that ends inside a multi-byte
    character (decoded as U+FFFD) decides nothing and is skipped. Exact up to tokens whose
    decoded texts coincide; tokens skipped just before a departure are counted as departed."""
    if hypothesis == prefixes[-1]:
        return None
    k = 0
    for j, p in enumerate(prefixes[1:], start=1):
        if p.endswith("\ufffd"):
            continue
        if not hypothesis.startswith(p):
            break
        k = j
    return k


def departure_recall(step_recall: np.ndarray, departure: int | None) -> dict[str, float]:
    """What replay's per-step attention recall showed before a live run departed.

    Token ``d >= 1`` is produced by decode step ``d - 1`` (token 0 by the prefill), so replay
    steps ``0 .. d-1`` saw the same tokens as the live run. Returns the mean recall over
    those steps and the recall of step ``d - 1`` (no departure: the mean over every step).
    """
    r = np.asarray(step_recall, dtype=np.float64)
    nan = float("nan")
    if departure is None or departure > len(r):
        return {"recall_before": float(r.mean()) if len(r) else nan, "recall_at": nan}
    if departure == 0:
        return {"recall_before": nan, "recall_at": nan}
    return {"recall_before": float(r[:departure].mean()), "recall_at": float(r[departure - 1])}


def at_risk_percentile(step_recall: Sequence[np.ndarray], departures: Sequence[int | None]) -> list[float]:
    """For each run of one clip that departs at token ``d >= 1``: the mid-rank percentile of
    its replay recall at step ``d - 1`` among the runs still on the full cache's tokens after
    that step (departing later or never), at the same step. Comparing runs at the same step
    removes any trend of recall over the answer; 0.5 when recall says nothing about which runs
    leave, low when the runs that leave are those whose recall is lowest. Runs that never
    compress (recall 1 at every step) are not compared against. NaN where undefined."""
    out = []
    compressed = [bool((np.asarray(r) < 1).any()) for r in step_recall]
    for r, d in zip(step_recall, departures, strict=True):
        if d is None or d == 0 or d > len(r):
            out.append(float("nan"))
            continue
        s = d - 1
        peers = np.array([q[s] for q, e, c in zip(step_recall, departures, compressed, strict=True)
                          if c and (e is None or e > d) and s < len(q)])
        at = r[s]
        out.append(float((peers < at).mean() + 0.5 * (peers == at).mean()) if len(peers) else float("nan"))
    return out
