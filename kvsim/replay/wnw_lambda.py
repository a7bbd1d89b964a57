"""WnW's λ fitted on the *measured* r_GPU of calibration traces (WnW §3.4).

The paper: "For WnW, we select λ on the calibration set so that the measured r_GPU matches
each target". Its measured r_GPU (WnW Tables 4 and 5) is the decode-time mean GPU-resident
fraction of the audio KV, recalled chunks included: replay's ``r_gpu``. Recalls come on top
of the prefill retention and released segments leave it, so the measured fit's λ lies below
the prefill fit's (:func:`kvsim.policies.wnw_calibrate.fit_lambda`) where recalls dominate
and above it where releases do.

Rule: the largest λ whose mean measured r_GPU over the calibration traces is at most the
target (never above it on the calibration set). The paper's measured figures are on the
*test* set (22.25% at a 0.2 target, WnW Table 5; 21.7% to 19.7% in Table 4), where a λ
fitted on a disjoint calibration set lands on either side of the target, so they are
consistent with this rule and do not single out a "nearest" one; "at most" is the rule
whose result never exceeds the target the user asked for on the data it was fitted on.

Search: measured r_GPU is assumed non-decreasing in λ (a larger λ keeps more at prefill;
recalls fill the budget's slack). Each pass replays ``per_pass`` λ candidates evenly spaced
inside the current bracket, as separate runs of one replay pass per trace, and narrows the
bracket to the two neighbours around the target; a warning names any candidate pair that
breaks monotonicity.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.policies.base import HeadScores
from kvsim.policies.spec import PolicySpec
from kvsim.policies.wnw import WnWBudgetWarning
from kvsim.policies.wnw_calibrate import fit_lambda
from kvsim.replay.engine import ReplayConfig, Replayer
from kvsim.trace.reader import Trace


@dataclass(frozen=True)
class MeasuredFit:
    """The result of :func:`search_lambda_measured`.

    ``lam`` is the fitted λ and ``r_gpu`` its mean measured r_GPU on the calibration traces;
    ``step`` the width of the final bracket (λ + step measures above the target; 0 when the
    target is not bracketed: ``lam`` is then the λ keeping everything, measuring at most the
    target, or 0 measuring above it); ``lam_prefill`` the prefill fit's λ; ``evaluated`` every
    (λ, mean measured r_GPU) replayed, sorted by λ.
    """

    lam: float
    r_gpu: float
    step: float
    lam_prefill: float
    evaluated: tuple[tuple[float, float], ...]


def calibration_replayers(traces: Sequence[str | Path | Trace], calibration: HeadScores | None,
                          cfg: ReplayConfig | None = None) -> list[Replayer]:
    """One replayer per calibration trace (``calibration`` overrides the traces' scores).

    Raises ``ValueError`` (one line) for a trace without decode steps: the measured r_GPU is
    a decode-time mean.
    """
    base = cfg or ReplayConfig(error_stride=1 << 30, topk=1)
    base = replace(base, head_scores=calibration if calibration is not None else base.head_scores)
    out = []
    for item in traces:
        trace = item if isinstance(item, Trace) else Trace(Path(item))
        if trace.meta.n_decode <= 1:
            raise ValueError(
                f"{trace.path}: n_decode={trace.meta.n_decode}; the measured-r_GPU λ fit needs "
                "traces with decode steps (record them with --max-new-tokens, or use --fit prefill)")
        out.append(Replayer(trace, base))
    if not out:
        raise ValueError("no calibration traces to fit λ on")
    return out


def measured_r_gpu(replayers: Sequence[Replayer], target: float, lams: Sequence[float],
                   **params: Any) -> np.ndarray:
    """Mean measured r_GPU (replay's ``r_gpu``) over ``replayers`` for each λ in ``lams``;
    all λ are separate runs of one replay pass per trace."""
    specs = [PolicySpec("wnw", target, {**params, "lam": float(lam)}) for lam in lams]
    per_trace = []
    for rep in replayers:
        results = rep.run(specs)
        if rep.failures:
            spec, why = rep.failures[0]
            raise ValueError(f"{rep.trace.path}: wnw cannot run ({why})")
        per_trace.append([r.summary["r_gpu"] for r in results])
    return np.mean(np.asarray(per_trace, dtype=np.float64), axis=0)


def search_lambda_measured(replayers: Sequence[Replayer], target: float, passes: int = 4,
                           per_pass: int = 6, **params: Any) -> MeasuredFit:
    """Largest λ whose mean measured r_GPU over ``replayers`` is at most ``target`` (§3.4).

    ``params`` are WnW's other hyperparameters (they enter the fit). The bracket starts at
    [0, prefill-fit λ] (measured r_GPU ≥ prefill r_GPU when recalls dominate); when the
    prefill-fit λ measures under the target (released segments outweigh recalls) a geometric
    pass up to the λ that keeps everything at prefill brackets it. It shrinks by
    ``per_pass + 1`` per pass. When even λ = 0 measures
    above the target (recalls alone exceed it), warns (:class:`WnWBudgetWarning`) and returns
    λ = 0, the closest feasible setting, with its r_GPU over the target.
    """
    lam_hi = fit_lambda([r.ctx for r in replayers], target, **params)
    seen: dict[float, float] = {}
    ends = [0.0, lam_hi] if lam_hi > 0 else [0.0]
    seen.update(zip(ends, measured_r_gpu(replayers, target, ends, **params), strict=True))
    if seen[0.0] > target + 1e-12:
        warnings.warn(f"wnw λ fit: at λ = 0 the measured r_GPU is already {seen[0.0]:.4f}, over "
                      f"the target r={target:g} (recalls alone exceed it); using λ = 0",
                      WnWBudgetWarning, stacklevel=2)
    lo, hi = 0.0, lam_hi
    lam_top = fit_lambda([r.ctx for r in replayers], 1.0, **params)  # prefill keeps all
    if seen[lam_hi] <= target + 1e-12 and lam_top > lam_hi:  # releases outweigh recalls
        grid = list(np.geomspace(lam_hi, lam_top, per_pass + 2)[1:])
        seen.update(zip(grid, measured_r_gpu(replayers, target, grid, **params), strict=True))
        lo, hi = _bracket(seen, lam_hi, lam_top, target)
    if seen[hi] <= target + 1e-12:  # even the top of the range measures under the target
        lo = hi
    bracketed = seen[lo] <= target + 1e-12 < seen[hi]
    for _ in range(passes if bracketed else 0):
        grid = list(np.linspace(lo, hi, per_pass + 2)[1:-1])
        seen.update(zip(grid, measured_r_gpu(replayers, target, grid, **params), strict=True))
        lo, hi = _bracket(seen, lo, hi, target)
    _warn_if_not_monotone(seen)
    step = hi - lo if bracketed else 0.0
    return MeasuredFit(lam=float(lo), r_gpu=float(seen[lo]), step=float(step),
                       lam_prefill=float(lam_hi),
                       evaluated=tuple((float(k), float(seen[k])) for k in sorted(seen)))


def _bracket(seen: dict[float, float], lo: float, hi: float, target: float) -> tuple[float, float]:
    """The largest replayed λ in [lo, hi] measuring at most ``target`` and the next one."""
    inside = [lam for lam in sorted(seen) if lo <= lam <= hi]
    fits = [lam for lam in inside if seen[lam] <= target + 1e-12]
    low = max(fits) if fits else lo
    return low, min((lam for lam in inside if lam > low), default=low)


def _warn_if_not_monotone(seen: dict[float, float]) -> None:
    """Warn when the measured r_GPU decreases between two replayed λ (the search's premise)."""
    lams = sorted(seen)
    for a, b in zip(lams, lams[1:], strict=False):
        if seen[b] < seen[a] - 1e-9:
            warnings.warn(
                f"wnw λ fit: measured r_GPU is not monotone in λ on these traces "
                f"(λ={a:.6g} → {seen[a]:.4f}, λ={b:.6g} → {seen[b]:.4f}); the fitted λ is the "
                "largest at or under the target among those replayed", stacklevel=3)
            return


def fit_lambda_measured(traces: Sequence[str | Path | Trace], target: float, *,
                        calibration: HeadScores | None = None, cfg: ReplayConfig | None = None,
                        **params: Any) -> float:
    """λ for WnW at ``target`` fitted on the measured r_GPU of ``traces`` (WnW §3.4).

    ``calibration`` (a heads.json's scores) replaces the traces' own; ``params`` are WnW's
    other hyperparameters. See :func:`search_lambda_measured` for the rule and the search.
    """
    return search_lambda_measured(calibration_replayers(traces, calibration, cfg), target,
                                  **params).lam
