"""Live decoding ms/token of ``wnw`` and ``arkvale`` against ``full`` on one minivox clip.

The three policies decode the same clip from one shared prefill, alternating (full, wnw,
arkvale, full, ...) so that machine load hits them alike; medians over the rounds. Two
figures per policy: the project's ms/token (the model's forward of a decode step, with the
policy's per-layer selection and step-attention work inside it) and the whole step (that plus
the policy's tier update after the step, and the step's share of the run's setup), from the
run's wall time. Target: wnw and arkvale <= 1.10x full.

Usage: python benchmarks/live_speed.py [--data /work/data/minivox] [--split test_30_60]
       [--clip 0] [--tokens 24] [--rounds 2] [--budget 0.2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from kvsim.live.data import from_manifest  # noqa: E402
from kvsim.live.decode import LiveConfig, live_generate, prefill_once  # noqa: E402
from kvsim.live.models import load_backbone  # noqa: E402
from kvsim.policies.spec import PolicySpec  # noqa: E402
from kvsim.trace.heads import read_heads  # noqa: E402

HEADS = Path(__file__).resolve().parent.parent / "minivox" / "heads.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("/work/data/minivox"))
    ap.add_argument("--split", default="test_30_60")
    ap.add_argument("--clip", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per run (<= 100)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_backbone("minivox")
    item = from_manifest(args.data / "manifest.parquet", args.split)[args.clip]
    audio, _ = item.load()
    prompt = lm.prepare(audio)
    prefilled = prefill_once(lm, prompt)
    cfg = LiveConfig(max_new_tokens=args.tokens, head_scores=read_heads(HEADS))
    specs = [PolicySpec("full", 1.0), PolicySpec("wnw", args.budget), PolicySpec("arkvale", args.budget)]
    ms: dict[str, list[float]] = {s.name: [] for s in specs}
    step: dict[str, list[float]] = {s.name: [] for s in specs}
    steps: dict[str, int] = {}
    tokens: dict[str, str] = {}
    for _ in range(args.rounds):
        for spec in specs:
            t0 = time.perf_counter()
            run = live_generate(lm, prompt, spec, cfg, prefilled=prefilled)
            wall = time.perf_counter() - t0
            n = max(run.summary["steps"], 1)
            ms[spec.name].append(run.summary["ms_per_token"])
            step[spec.name].append(1e3 * wall / n)
            steps[spec.name] = run.summary["steps"]
            tokens[spec.name] = hashlib.sha256(str(run.tokens).encode()).hexdigest()[:12]
    print(f"minivox {item.id}: {prompt.n_audio} audio tokens, {prompt.n_prompt} prompt positions; "
          f"budget {args.budget:g}; {args.rounds} alternating rounds, medians")
    base_ms, base_step = statistics.median(ms["full"]), statistics.median(step["full"])
    for spec in specs:
        m, s = statistics.median(ms[spec.name]), statistics.median(step[spec.name])
        print(f"  {spec.name:8s} {steps[spec.name]:3d} steps  ms/token {m:8.1f} ({m / base_ms:.3f}x full)  "
              f"whole step {s:8.1f} ms ({s / base_step:.3f}x full)  tokens {tokens[spec.name]}  raw ms/token {[round(x, 1) for x in ms[spec.name]]}")


if __name__ == "__main__":
    main()
