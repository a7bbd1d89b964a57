"""Replay engine speed, measured side by side in one run (ratios, not absolute times).

(a) replay of ``snapkv`` ÷ the bare ``q·Kᵀ`` + softmax over the same steps and layers
    (both include converting the stored fp16 keys to fp32), target <= 1.2; the bare pass
    computes the decode steps in blocks as the replay does (``ReplayConfig.attention_block_mib``,
    :func:`kvsim.core.attention.decode_attention_block`), and the same pass one step at a time
    is timed beside it (the replay's speed-up from blocks);
(b) replay of 8 policy/budget combinations in one pass ÷ replay of one, target <= 2.5;
and what the default metrics cost in (a): the same ``snapkv`` replay without the sampled
output error (``error_stride`` past the last step but step 0), and without the top-K Jaccard
as well (``topk`` = T_a: every read position counts, no ranking), each ÷ the bare pass;
and the bare pass's share of the machine's float32 matrix-multiply throughput (its logits'
FLOPs over its time, against one core's 2048 x 2048 float32 matmul). Times are wall clock and
this process's CPU time (one BLAS thread; steadier when the machine is loaded).

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

import numpy as np  # noqa: E402

from kvsim.core.attention import as_f32, decode_attention_block, gqa_logits, softmax_  # noqa: E402
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace  # noqa: E402
from kvsim.replay.tensors import steps_per_block  # noqa: E402
from kvsim.synth import SynthConfig, synthesize  # noqa: E402
from kvsim.trace import Trace, write_trace  # noqa: E402

EIGHT = [PolicySpec(n, b) for n in ("snapkv", "streaming", "h2o", "random") for b in (0.2, 0.6)]


def bare(trace: Trace, steps: int) -> None:
    """The irreducible work: full attention probabilities of every decode step and layer,
    ``steps_per_block`` steps per product as the replay computes them."""
    meta = trace.meta
    keys = [as_f32(trace.keys(layer)) for layer in range(meta.model.n_layers)]
    block = steps_per_block(trace.head_layout, meta.n_positions,
                            int(ReplayConfig().attention_block_mib * 2**20))
    for first in range(0, steps, block):
        positions = np.arange(meta.n_prefill + first, meta.n_prefill + min(first + block, steps))
        rows = [trace.query_index(int(p)) for p in positions]
        for layer, k in enumerate(keys):
            q = np.ascontiguousarray(as_f32(trace.queries(layer)[:, rows]))
            decode_attention_block(q, k, positions)


def bare_per_step(trace: Trace, steps: int) -> None:
    """The same probabilities one step and layer at a time (``attention_block_mib=0``)."""
    keys = [as_f32(trace.keys(layer)) for layer in range(trace.meta.model.n_layers)]
    for s in range(steps):
        p = trace.meta.n_prefill + s
        row = trace.query_index(p)
        for layer, k in enumerate(keys):
            softmax_(gqa_logits(as_f32(trace.queries(layer)[:, row]), k[:, : p + 1]))


def timed(fn) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of ``fn()``."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def bare_flops(trace: Trace, steps: int) -> float:
    """Floating-point operations of the bare pass's logits: 2·H_q·(p + 1)·D per layer and step."""
    h = trace.head_layout
    return float(sum(2 * h.n_q_heads * (trace.meta.n_prefill + s + 1) * h.head_dim * h.n_layers
                     for s in range(steps)))


def matmul_flops_per_s(n: int = 2048, repeats: int = 3) -> float:
    """The machine's float32 matrix-multiply throughput on one core: best of ``repeats``
    ``n x n`` products, CPU time."""
    rng = np.random.default_rng(0)
    a, b = (rng.random((n, n), dtype=np.float32) for _ in range(2))
    best = min(timed(lambda: a @ b)[1] for _ in range(repeats))
    return 2.0 * n**3 / best


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
        no_error = ReplayConfig(error_stride=args.steps)  # step 0 only
        recall_only = ReplayConfig(error_stride=args.steps, topk=trace.n_audio)
        t_bare, t_one, t_eight, t_step, t_no_error, t_recall = [], [], [], [], [], []
        for _ in range(args.rounds):  # interleaved so that machine noise hits all alike
            t_step.append(timed(lambda: bare_per_step(trace, args.steps)))
            t_bare.append(timed(lambda: bare(trace, args.steps)))
            t_one.append(timed(lambda: replay_trace(trace, [PolicySpec("snapkv", 0.2)], cfg)))
            t_eight.append(timed(lambda: replay_trace(trace, EIGHT, cfg)))
            t_no_error.append(timed(lambda: replay_trace(trace, [PolicySpec("snapkv", 0.2)], no_error)))
            t_recall.append(timed(lambda: replay_trace(trace, [PolicySpec("snapkv", 0.2)], recall_only)))
        peak = matmul_flops_per_s()
        for i, clock in enumerate(("wall", "CPU")):
            b, o, e, p = (statistics.median(x[i] for x in t) for t in (t_bare, t_one, t_eight, t_step))
            print(f"{clock}, median of {args.rounds} rounds: bare q·Kᵀ+softmax {b:.2f} s "
                  f"({p:.2f} s one step at a time: blocks {p / b:.2f}x faster), "
                  f"snapkv {o:.2f} s, 8 runs {e:.2f} s")
            print(f"  (a) snapkv replay / bare attention = {o / b:.2f}   (target <= 1.2)")
            print(f"  (b) 8 policy/budget runs / 1 run    = {e / o:.2f}   (target <= 2.5)")
            n, r = (statistics.median(x[i] for x in t) for t in (t_no_error, t_recall))
            print(f"  snapkv without output error / bare = {n / b:.2f}; recall only / bare = {r / b:.2f}")
        for name, t in (("bare pass", t_bare), ("one step at a time", t_step)):
            rate = bare_flops(trace, args.steps) / statistics.median(x[1] for x in t)
            print(f"{name}: {rate / 1e9:.1f} GFLOP/s (its logits' FLOPs over its CPU time) = "
                  f"{100 * rate / peak:.1f}% of this core's float32 matmul, {peak / 1e9:.1f} GFLOP/s")
        print("    8 runs: " + ", ".join(f"{s.name}@{s.budget:g}" for s in EIGHT))


if __name__ == "__main__":
    main()
