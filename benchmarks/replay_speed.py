"""Replay engine speed, measured side by side in one run (ratios, not absolute times).

(a) replay of ``snapkv`` ÷ the bare ``q·Kᵀ`` + softmax over the same steps and layers
    (both include converting the stored fp16 keys to fp32), target <= 1.5;
(b) replay of 8 policy/budget combinations in one pass ÷ replay of one, target <= 2.5.

Usage: python benchmarks/replay_speed.py [--seconds 120] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


from kvsim.core.attention import as_f32, gqa_logits, softmax_  # noqa: E402
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace  # noqa: E402
from kvsim.synth import SynthConfig, synthesize  # noqa: E402
from kvsim.trace import Trace, write_trace  # noqa: E402

EIGHT = [PolicySpec(n, b) for n in ("snapkv", "streaming", "h2o", "random") for b in (0.2, 0.6)]


def bare(trace: Trace, steps: int) -> None:
    """The irreducible work: full attention probabilities of every decode step and layer."""
    keys = [as_f32(trace.keys(layer)) for layer in range(trace.meta.model.n_layers)]
    for s in range(steps):
        p = trace.meta.n_prefill + s
        row = trace.query_index(p)
        for layer, k in enumerate(keys):
            softmax_(gqa_logits(as_f32(trace.queries(layer)[:, row]), k[:, : p + 1]))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--error-stride", type=int, default=ReplayConfig().error_stride)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(Path(tmp) / "vox.kvtrace", synthesize(SynthConfig(
            preset="voxtral-mini", audio_seconds=args.seconds, decode_steps=args.steps, seed=0)))
        trace = Trace(path)
        cfg = ReplayConfig(error_stride=args.error_stride)
        print(f"trace: voxtral-mini shape, {trace.n_audio} audio tokens ({trace.audio_seconds:.0f} s), "
              f"{args.steps} decode steps, values stored, output error every {cfg.error_stride} steps")
        t_bare, t_one, t_eight = [], [], []
        for _ in range(args.rounds):  # interleaved so that machine noise hits all three alike
            t_bare.append(timed(lambda: bare(trace, args.steps)))
            t_one.append(timed(lambda: replay_trace(trace, [PolicySpec("snapkv", 0.2)], cfg)))
            t_eight.append(timed(lambda: replay_trace(trace, EIGHT, cfg)))
        b, o, e = (statistics.median(x) for x in (t_bare, t_one, t_eight))
        print(f"median of {args.rounds} rounds: bare q·Kᵀ+softmax {b:.2f} s, snapkv {o:.2f} s, "
              f"8 runs {e:.2f} s")
        print(f"(a) snapkv replay / bare attention = {o / b:.2f}   (target <= 1.5)")
        print(f"(b) 8 policy/budget runs / 1 run    = {e / o:.2f}   (target <= 2.5)")
        print("    8 runs: " + ", ".join(f"{s.name}@{s.budget:g}" for s in EIGHT))


if __name__ == "__main__":
    main()
