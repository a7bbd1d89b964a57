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

import hashlib
import statistics
import time

from _minivox_clip import HEADS, clip_options, prefilled_clip

from kvsim.live.decode import LiveConfig, live_generate
from kvsim.policies.spec import PolicySpec
from kvsim.trace.heads import read_heads


def main() -> None:
    args = clip_options("test_30_60", clip=0, tokens=24, rounds=2).parse_args()
    lm, item, prompt, prefilled = prefilled_clip(args)
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
