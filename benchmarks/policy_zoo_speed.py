"""Replaying every policy at four budgets in one pass vs replaying ``full`` alone.

Prints the ratio (target <= 1.5) and each policy's own decision time, measured side by side in
one run over the shipped traces (or the traces given), alternating full / all every round. The
ratio is given in wall time and in this process's CPU time: on a machine loaded by other work
the CPU time (one BLAS thread) is the steadier figure.

Usage: python benchmarks/policy_zoo_speed.py [TRACES...] [--rounds 2] [--attention-block-mib M]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from kvsim.policies import registry  # noqa: E402
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace  # noqa: E402
from kvsim.specs import default_trace_dir  # noqa: E402
from kvsim.trace import Trace, find_traces  # noqa: E402

BUDGETS = (0.2, 0.4, 0.6, 0.8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--attention-block-mib", type=float, default=ReplayConfig.attention_block_mib,
                    help="ReplayConfig.attention_block_mib (0: one decode step at a time)")
    args = ap.parse_args()
    traces = [Trace(p) for p in find_traces(args.traces or [default_trace_dir()])]
    names = [n for n in registry.available() if not n.startswith("_")]
    everything = [PolicySpec(n, b) for n in names for b in BUDGETS]
    cfg = ReplayConfig(attention_block_mib=args.attention_block_mib)
    t_full, t_all, c_full, c_all = [], [], [], []
    per_policy: dict[str, float] = {}
    for _ in range(args.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        for t in traces:
            replay_trace(t, [PolicySpec("full", 1.0)], cfg)
        t_full.append(time.perf_counter() - t0)
        c_full.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        for t in traces:
            for r in replay_trace(t, everything, cfg):
                per_policy[r.spec.name] = per_policy.get(r.spec.name, 0.0) + r.summary["policy_seconds"]
        t_all.append(time.perf_counter() - t0)
        c_all.append(time.process_time() - c0)
    f, a = statistics.median(t_full), statistics.median(t_all)
    cf, ca = statistics.median(c_full), statistics.median(c_all)
    print(f"{len(traces)} traces; {len(names)} policies x {len(BUDGETS)} budgets = {len(everything)} runs per trace")
    print(f"full alone {f:.2f} s; all runs in one pass {a:.2f} s (median of {args.rounds})")
    print(f"ratio all / full = {a / f:.2f}   (target <= 1.5)")
    print(f"CPU time: full alone {cf:.2f} s; all runs {ca:.2f} s; ratio {ca / cf:.2f}")
    print("policy decision time (prefill + steps + select), summed over budgets and rounds:")
    for n, s in sorted(per_policy.items(), key=lambda kv: -kv[1]):
        print(f"  {n:10s} {s / args.rounds:6.2f} s")


if __name__ == "__main__":
    main()
