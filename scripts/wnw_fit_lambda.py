"""Fit WnW's λ per target r_GPU on calibration traces (WnW §3.4) and print ``wnw:lam=...``.

Usage: python scripts/wnw_fit_lambda.py [--calibration heads.json] [-b 0.1,0.2,0.4]
       [--fit measured|prefill] [-p key=value ...] TRACE [TRACE ...]

The paper selects λ "on the calibration set so that the measured r_GPU matches each target".
``--fit measured`` (the default, the paper's) fits, per target, the largest λ whose mean
*measured* r_GPU (replayed decode-time mean, recalls included) over the given traces is at
most the target (:mod:`kvsim.replay.wnw_lambda`; the traces need decode steps).
``--fit prefill`` is kvsim's earlier fit: the largest λ whose mean *prefill* r_GPU is at most
the target, recalls then coming on top. Prints one policy argument per target to pass to
``kvsim replay`` or ``kvsim live`` on the test inputs. Use traces of a calibration split
disjoint from the test inputs.
"""

from __future__ import annotations

import argparse
import sys

from kvsim.policies.base import PolicyContext
from kvsim.policies.wnw_calibrate import fit_lambda_table
from kvsim.replay.engine import trace_context
from kvsim.replay.wnw_lambda import calibration_replayers, search_lambda_measured
from kvsim.specs import _value, parse_budgets
from kvsim.trace.heads import read_heads
from kvsim.trace.reader import Trace, find_traces
from kvsim.trace.schema import TraceError


def contexts(paths: list, heads_file: str | None) -> list[PolicyContext]:
    """The policy context of each trace, as the replay engine builds it."""
    scores = read_heads(heads_file) if heads_file else None
    return [trace_context(Trace(path), scores) for path in find_traces(paths)]


def fit_table(paths: list, heads_file: str | None, budgets: list[float], how: str,
              params: dict) -> dict[float, float]:
    """``{target: λ}`` under the ``measured`` (WnW §3.4) or the ``prefill`` fit."""
    if how == "prefill":
        return fit_lambda_table(contexts(paths, heads_file), budgets, **params)
    scores = read_heads(heads_file) if heads_file else None
    replayers = calibration_replayers(find_traces(paths), scores)
    return {float(b): search_lambda_measured(replayers, float(b), **params).lam for b in budgets}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("-b", "--budget", default="0.1,0.2,0.4,0.6,0.8")
    ap.add_argument("--calibration", default=None, help="heads.json (else the traces' scores)")
    ap.add_argument("--fit", choices=("measured", "prefill"), default="measured",
                    help="measured: decode-time r_GPU with recalls (WnW §3.4, default); "
                         "prefill: prefill r_GPU only")
    ap.add_argument("-p", "--param", action="append", default=[], help="WnW key=value")
    args = ap.parse_args(argv)
    try:
        params = {k: _value(v) for k, v in (p.split("=", 1) for p in args.param)}
        table = fit_table(args.traces, args.calibration, parse_budgets(args.budget), args.fit,
                          params)
    except (ValueError, KeyError, FileNotFoundError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    extra = "".join(f":{p}" for p in args.param)
    for r, lam in table.items():
        print(f"-b {r:g} -p wnw:lam={lam:.6g}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
