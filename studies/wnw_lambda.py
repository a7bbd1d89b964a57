"""WnW's λ for a study's live grid: fitted per target on calibration traces (WnW §3.4), and
the plan items that run WnW with it.

The paper selects λ "on the calibration set so that the measured r_GPU matches each target":
one λ per target r_GPU (and per head configuration), passed to every test input. By default
λ is fitted on the measured (decode-time, recalls included) r_GPU of the calibration traces
(:mod:`kvsim.replay.wnw_lambda`); ``fit="prefill"`` keeps kvsim's earlier prefill-r_GPU fit.
Without calibration traces WnW fits λ on each input itself (a warning says so at run time);
a study then says so in its notes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsim.live.run import PlanItem, make_plan
from kvsim.policies.base import HeadScores, PolicyContext
from kvsim.policies.wnw_calibrate import fit_lambda

FITS = ("measured", "prefill")


@dataclass
class CalibrationSet:
    """Calibration traces and how λ is fitted on them (``measured``: WnW §3.4, the default).

    Behaves as the sequence of the traces' policy contexts (``len``, iteration, truth).
    """

    paths: list[Path]
    contexts: list[PolicyContext]
    scores: HeadScores | None = None
    fit: str = "measured"
    _replayers: list | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.contexts)

    def __iter__(self) -> Iterator[PolicyContext]:
        return iter(self.contexts)

    def lam(self, budget: float, **params: Any) -> float:
        """λ for WnW at ``budget`` with hyperparameters ``params``, under :attr:`fit`."""
        if self.fit == "prefill":
            return fit_lambda(self.contexts, budget, **params)
        from kvsim.replay.wnw_lambda import calibration_replayers, search_lambda_measured

        if self._replayers is None:  # traces loaded once for every target and setting
            self._replayers = calibration_replayers(self.paths, self.scores)
        return search_lambda_measured(self._replayers, budget, **params).lam


def calibration_contexts(paths: Sequence[Path], scores: HeadScores | None,
                         fit: str = "measured") -> CalibrationSet:
    """The calibration set: each trace's policy context (shapes, T_a, r_tok, head scores), as
    the replay engine builds it; ``scores`` (a heads.json) replaces the traces' own scores;
    ``fit`` is ``measured`` (WnW §3.4, needs decode steps) or ``prefill``."""
    from kvsim.replay.engine import trace_context
    from kvsim.trace.reader import Trace, find_traces

    if fit not in FITS:
        raise ValueError(f"λ fit {fit!r}: expected one of {', '.join(FITS)}")
    found, out = find_traces([str(p) for p in paths]), []
    for path in found:
        out.append(trace_context(Trace(path), scores))
    if not out:
        raise FileNotFoundError(f"{', '.join(map(str, paths))}: no calibration traces")
    return CalibrationSet(list(found), out, scores, fit)


def wnw_items(budgets: Sequence[float],
              contexts: CalibrationSet | Sequence[PolicyContext] | None,
              **params: Any) -> list[PlanItem]:
    """One ``wnw`` plan item per budget: with ``contexts``, at the λ fitted on them for that
    budget (``wnw:lam=...``; a :class:`CalibrationSet` under its fit, plain policy contexts
    under the prefill fit); without, WnW fits λ per input at run time.

    ``params`` are WnW's other hyperparameters (``n_voice``, ``n_anchor``, ...): they change
    the roles and hence the fitted λ, so they enter the fit too.
    """
    extra = "".join(f":{k}={v}" for k, v in params.items())
    items: list[PlanItem] = []
    for b in budgets:
        if contexts:
            lam = (contexts.lam(float(b), **params) if isinstance(contexts, CalibrationSet)
                   else fit_lambda(contexts, float(b), **params))
            items += make_plan([f"wnw:lam={lam:.6g}{extra}"], [b])
        else:
            items += make_plan([f"wnw{extra}"], [b])
    return items


def lambda_of(item: PlanItem) -> float | None:
    """The λ a WnW plan item runs with (None: fitted per input)."""
    lam = item.spec.params.get("lam")
    return None if lam is None else float(lam)
