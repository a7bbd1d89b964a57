"""Replay time and peak memory against the number of runs in one pass.

Synthesises one Voxtral-mini-shaped trace (values stored), then replays it with R policy ×
budget runs for each R given, each in a fresh process (its own peak RSS), R = 1 being
``snapkv`` alone and larger R adding the other policies at four budgets in registry order.
Prints, per R: wall and CPU seconds of the replay (the trace's load included), peak RSS, and
the ratios to R = 1 side by side.

Usage: python benchmarks/runs_scaling.py [--seconds 120] [--steps 50] [--runs 1 4 13 26 52]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

BUDGETS = (0.2, 0.4, 0.6, 0.8)

CHILD = f"""
BUDGETS = {BUDGETS!r}
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from kvsim.policies import registry
from kvsim.replay.engine import PolicySpec, replay_trace
from kvsim.trace import Trace

path, n_runs = sys.argv[1], int(sys.argv[2])
names = ["snapkv"] + [n for n in registry.available() if not n.startswith("_") and n != "snapkv"]
specs = [PolicySpec(n, b) for n in names for b in BUDGETS]
specs = [PolicySpec("snapkv", 0.2)] if n_runs == 1 else specs[:n_runs]
t0, c0 = time.perf_counter(), time.process_time()
replay_trace(Trace(path), specs)
print(json.dumps({{"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                  "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}}))
"""


def measure(path: Path, n_runs: int) -> dict:
    """Wall, CPU seconds and peak RSS (GB) of replaying ``n_runs`` runs in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(n_runs)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 4, 13, 26, 52])
    args = ap.parse_args()
    from kvsim.synth import SynthConfig, write_synthetic
    from kvsim.trace import Trace

    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic(Path(tmp) / "vox", SynthConfig(
            preset="voxtral-mini", audio_seconds=args.seconds, decode_steps=args.steps, seed=0))
        trace = Trace(path)
        print(f"trace: voxtral-mini shape, {trace.n_audio} audio tokens ({args.seconds:.0f} s), "
              f"{args.steps} decode steps, values stored")
        rows = [(r, measure(path, r)) for r in args.runs]
    base = rows[0][1]
    print(f"{'runs':>5} {'wall s':>8} {'CPU s':>8} {'peak GB':>8}  {'wall ÷ R=' + str(rows[0][0]):>12}"
          f" {'peak ÷':>7}")
    for r, m in rows:
        print(f"{r:5d} {m['wall']:8.2f} {m['cpu']:8.2f} {m['peak_gb']:8.2f}  "
              f"{m['wall'] / base['wall']:12.2f} {m['peak_gb'] / base['peak_gb']:7.2f}")


if __name__ == "__main__":
    main()
