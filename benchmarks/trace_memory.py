"""Peak memory of tracing: decode steps recorded into preallocated buffers vs one tensor per step.

The tracer's ``Recorder`` writes every decode step into one buffer per layer and tensor
(``decode_capacity = max_new_tokens``). The alternative, one small tensor per layer and step,
interleaves thousands of small allocations with the KV cache that grows every step, and
fragments glibc's heap. Each mode runs in a fresh process (peak RSS is per process), in the
order A B B A; both must decode the same tokens (checked). Prints peak RSS, wall time and
decode ms/token per run, and the ratios per-step / buffered.

    python benchmarks/trace_memory.py AUDIO [--model minivox] [--max-new-tokens 400]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def child(audio: str, model: str, new_tokens: int, buffered: bool) -> None:
    import torch

    import kvsim.tracer.run as run
    from kvsim.tracer.audio import load_audio
    from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone
    from kvsim.tracer.capture import Recorder

    torch.set_num_threads(1)
    if not buffered:  # the same recorder with one tensor per decode step
        class PerStepRecorder(Recorder):
            def __post_init__(self) -> None:
                self.decode_capacity = None
                super().__post_init__()

        run.Recorder = PerStepRecorder
    backbone = load_backbone(model, LoadOptions())
    prepared = backbone.prepare(load_audio(Path(audio), backbone.sample_rate), PromptSpec())
    t0 = time.perf_counter()
    gen = run.generate_traced(backbone, prepared, run.TraceOptions(max_new_tokens=new_tokens))
    wall = time.perf_counter() - t0
    n_dec = len(gen.tokens) - 1
    print(json.dumps({
        "tokens": gen.tokens, "wall_s": wall,
        "ms_per_token": 1000 * (gen.total_s - gen.prefill_s) / max(n_dec, 1),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("audio")
    ap.add_argument("--model", default="minivox")
    ap.add_argument("--max-new-tokens", type=int, default=400)
    ap.add_argument("--child", choices=["buffered", "per-step"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.audio, args.model, args.max_new_tokens, args.child == "buffered")
        return
    if not Path(args.audio).is_file():
        sys.exit(f"{args.audio}: not found")
    results: dict[str, list[dict]] = {"per-step": [], "buffered": []}
    for mode in ("per-step", "buffered", "buffered", "per-step"):
        out = subprocess.run([sys.executable, __file__, args.audio, "--model", args.model,
                              "--max-new-tokens", str(args.max_new_tokens), "--child", mode],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results[mode].append(r)
        print(f"{mode:9s} peak RSS {r['peak_rss_mb']:7.0f} MB  wall {r['wall_s']:6.1f} s  "
              f"decode {r['ms_per_token']:6.1f} ms/token  ({len(r['tokens'])} tokens)", flush=True)
    tokens = {tuple(r["tokens"]) for rs in results.values() for r in rs}
    if len(tokens) != 1:
        sys.exit("the runs decoded different tokens")
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("peak_rss_mb", "wall_s", "ms_per_token")}
           for m, rs in results.items()}
    for k in ("peak_rss_mb", "wall_s", "ms_per_token"):
        print(f"per-step / buffered, {k}: {med['per-step'][k] / med['buffered'][k]:.2f}")


if __name__ == "__main__":
    main()
