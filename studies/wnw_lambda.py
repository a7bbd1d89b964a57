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

import uuid
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
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

    def lams(self, targets: Sequence[tuple[float, dict[str, Any]]], ray: str | None = None) -> list[float]:
        """:meth:`lam` of every ``(budget, params)`` in ``targets``, in order.

        With ``ray`` (a Ray address; ``local`` starts a local Ray) every fit is one Ray task
        (each worker loads the calibration traces once) and the warnings the fits raise are
        raised again here, so a caller collecting them sees what a local run would; the λ are
        the same computation on the same traces, so they equal the local ones.
        """
        if ray is None or len(targets) < 2:
            return [self.lam(budget, **params) for budget, params in targets]
        from kvsim.cluster import connect

        cluster = connect(ray)
        shipped = cluster.put((uuid.uuid4().hex, replace(self, _replayers=None)))
        task = cluster.remote(num_cpus=1)(_fit_task)
        out = []
        for lam, caught in cluster.get([task.remote(shipped, b, p) for b, p in targets]):
            for category, message in caught:
                warnings.warn(message, category, stacklevel=2)
            out.append(lam)
        return out


#: Per Ray worker: the calibration sets it has loaded, by the token the driver gave them.
_WORKER_SETS: dict[str, CalibrationSet] = {}


def _fit_task(shipped: tuple[str, CalibrationSet], budget: float,
              params: dict[str, Any]) -> tuple[float, list[tuple[type[Warning], str]]]:
    """One λ fit in a Ray worker, and the warnings it raised (category, message)."""
    token, calib = shipped
    calib = _WORKER_SETS.setdefault(token, calib)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lam = calib.lam(budget, **params)
    return lam, [(w.category, str(w.message)) for w in caught]


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
              ray: str | None = None, **params: Any) -> list[PlanItem]:
    """One ``wnw`` plan item per budget: with ``contexts``, at the λ fitted on them for that
    budget (``wnw:lam=...``; a :class:`CalibrationSet` under its fit, one Ray task per budget
    with ``ray``; plain policy contexts under the prefill fit); without, WnW fits λ per input
    at run time.

    ``params`` are WnW's other hyperparameters (``n_voice``, ``n_anchor``, ...): they change
    the roles and hence the fitted λ, so they enter the fit too.
    """
    lams = fitted_lambdas(contexts, [(float(b), params) for b in budgets], ray)
    return [wnw_item(b, None if lams is None else lams[i], params) for i, b in enumerate(budgets)]


def fitted_lambdas(contexts: CalibrationSet | Sequence[PolicyContext] | None,
                   targets: Sequence[tuple[float, dict[str, Any]]],
                   ray: str | None = None) -> list[float] | None:
    """λ of every ``(budget, params)`` fitted on ``contexts`` (see :func:`wnw_items`); None
    without contexts."""
    if not contexts:
        return None
    if isinstance(contexts, CalibrationSet):
        return contexts.lams(targets, ray)
    return [fit_lambda(contexts, budget, **params) for budget, params in targets]


def wnw_item(budget: float, lam: float | None, params: dict[str, Any]) -> PlanItem:
    """The ``wnw`` plan item at ``budget`` with ``params``: at ``lam`` (printed to 6 digits),
    or, with None, fitting λ per input at run time."""
    extra = "".join(f":{k}={v}" for k, v in params.items())
    label = f"wnw:lam={lam:.6g}{extra}" if lam is not None else f"wnw{extra}"
    (item,) = make_plan([label], [budget])
    return item


def lambda_of(item: PlanItem) -> float | None:
    """The λ a WnW plan item runs with (None: fitted per input)."""
    lam = item.spec.params.get("lam")
    return None if lam is None else float(lam)
