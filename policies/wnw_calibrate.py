"""WnW's λ per target from a calibration set (WnW §3.4).

The paper: "For WnW, we select λ on the calibration set so that the measured r_GPU matches
each target". At prefill the measured r_GPU of an input is a function of λ alone (the roles
come from the head scores, the per-segment quota from eq. (1) and the segment lengths), so
λ is fitted as the largest value whose *mean* prefill retention over the calibration inputs
is at most the target; recalls come on top during decoding. The fitted λ is then passed to
every test input as ``wnw:lam=...`` (one value per target).

The inputs are :class:`kvsim.policies.base.PolicyContext` objects (shapes, T_a, r_tok, head
scores); ``kvsim`` builds them from traces (``scripts/wnw_fit_lambda.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsim.policies._wnw_layout import fit_lambda_mean
from kvsim.policies.base import PolicyContext
from kvsim.policies.registry import make


def fit_lambda(contexts: Sequence[PolicyContext], budget: float, **params: Any) -> float:
    """λ for WnW at target ``budget`` fitted on ``contexts`` (the calibration inputs).

    ``params`` are WnW's other hyperparameters (``n_voice``, ``n_anchor``,
    ``triage_signal``, ``min_per_segment``, chunk geometry), which change the roles and the
    quota and therefore the fit. Returns the largest λ with mean prefill r_GPU <= budget.
    """
    pol = make("wnw", budget, **params)
    cases = [pol.lambda_problem(ctx) for ctx in contexts]
    return fit_lambda_mean(cases, budget, pol.min_per_segment, pol.name)


def fit_lambda_table(contexts: Sequence[PolicyContext], budgets: Sequence[float],
                     **params: Any) -> dict[float, float]:
    """:func:`fit_lambda` for each target in ``budgets``: ``{r_GPU: λ}``."""
    return {float(b): fit_lambda(contexts, b, **params) for b in budgets}
