"""WnW's λ for a study's live grid: fitted per target on calibration traces (WnW §3.4), and
the plan items that run WnW with it.

The paper selects λ "on the calibration set so that the measured r_GPU matches each target":
one λ per target r_GPU (and per head configuration), passed to every test input. Without
calibration traces WnW fits λ on each input itself (a warning says so at run time); a study
then says so in its notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsim.live.run import PlanItem, make_plan
from kvsim.policies.base import HeadScores, PolicyContext
from kvsim.policies.wnw_calibrate import fit_lambda


def calibration_contexts(paths: Sequence[Path], scores: HeadScores | None) -> list[PolicyContext]:
    """The policy context of each calibration trace (shapes, T_a, r_tok, head scores), as the
    replay engine builds it; ``scores`` (a heads.json) replaces the traces' own scores."""
    from kvsim.trace.reader import Trace, find_traces

    out = []
    for path in find_traces([str(p) for p in paths]):
        trace = Trace(path)
        out.append(PolicyContext(
            heads=trace.head_layout, n_audio=len(trace.audio_positions),
            audio_tokens_per_s=trace.meta.model.audio_tokens_per_s, n_prefill=trace.meta.n_prefill,
            head_scores=scores if scores is not None else trace.head_scores))
    if not out:
        raise FileNotFoundError(f"{', '.join(map(str, paths))}: no calibration traces")
    return out


def wnw_items(budgets: Sequence[float], contexts: Sequence[PolicyContext] | None,
              **params: Any) -> list[PlanItem]:
    """One ``wnw`` plan item per budget: with ``contexts``, at the λ fitted on them for that
    budget (``wnw:lam=...``); without, WnW fits λ per input at run time.

    ``params`` are WnW's other hyperparameters (``n_voice``, ``n_anchor``, ...): they change
    the roles and hence the fitted λ, so they enter the fit too.
    """
    extra = "".join(f":{k}={v}" for k, v in params.items())
    items: list[PlanItem] = []
    for b in budgets:
        if contexts:
            lam = fit_lambda(contexts, float(b), **params)
            items += make_plan([f"wnw:lam={lam:.6g}{extra}"], [b])
        else:
            items += make_plan([f"wnw{extra}"], [b])
    return items


def lambda_of(item: PlanItem) -> float | None:
    """The λ a WnW plan item runs with (None: fitted per input)."""
    lam = item.spec.params.get("lam")
    return None if lam is None else float(lam)
