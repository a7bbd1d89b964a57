"""Live decoding ms/token with the decoding options (read window + cycle ban) against without.

``full`` and ``wnw`` decode one long-form minivox clip from one shared prefill, each with and
without ``--read-window 2,3,8 --ban-cycles 16,3``, alternating (full, full+options, wnw,
wnw+options, full, ...) so that machine load hits them alike; medians over the rounds. The
options' cost is the four aligning layers' float32 softmax over the context (computed beside
sdpa to move the read position) and the ban's scan of the last tokens. Both runs of a pair
stop at the same token count (``--tokens``), so the figure compares like with like even where
the options change the tokens.

Usage: python benchmarks/live_guides_speed.py [--data /work/data/minivox] [--split test_long]
       [--clip 7] [--tokens 32] [--rounds 3] [--budget 0.2]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from kvsim.decoding.cycle_ban import CycleBanConfig  # noqa: E402
from kvsim.decoding.read_window import ReadWindowConfig  # noqa: E402
from kvsim.live.data import from_manifest  # noqa: E402
from kvsim.live.decode import LiveConfig, live_generate, prefill_once  # noqa: E402
from kvsim.live.models import load_backbone  # noqa: E402
from kvsim.policies.spec import PolicySpec  # noqa: E402
from kvsim.trace.heads import read_heads  # noqa: E402

HEADS = Path(__file__).resolve().parent.parent / "minivox" / "heads.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("/work/data/minivox"))
    ap.add_argument("--split", default="test_long")
    ap.add_argument("--clip", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_backbone("minivox")
    item = from_manifest(args.data / "manifest.parquet", args.split)[args.clip]
    audio, _ = item.load()
    prompt = lm.prepare(audio)
    prefilled = prefill_once(lm, prompt)
    plain = LiveConfig(max_new_tokens=args.tokens, head_scores=read_heads(HEADS))
    guided = LiveConfig(max_new_tokens=args.tokens, head_scores=plain.head_scores,
                        read_window=ReadWindowConfig.parse("2,3,8"), ban_cycles=CycleBanConfig.parse("16,3"))
    runs = [(spec, name, cfg) for spec in (PolicySpec("full", 1.0), PolicySpec("wnw", args.budget))
            for name, cfg in (("plain", plain), ("options", guided))]
    ms: dict[tuple[str, str], list[float]] = {(s.name, n): [] for s, n, _ in runs}
    steps: dict[tuple[str, str], int] = {}
    for _ in range(args.rounds):
        for spec, name, cfg in runs:
            run = live_generate(lm, prompt, spec, cfg, prefilled=prefilled)
            ms[spec.name, name].append(run.summary["ms_per_token"])
            steps[spec.name, name] = run.summary["steps"]
    print(f"minivox {item.id}: {prompt.n_audio} audio tokens, {prompt.n_prompt} prompt positions; "
          f"wnw at {args.budget:g}; {args.rounds} alternating rounds, medians")
    for spec in ("full", "wnw"):
        base = statistics.median(ms[spec, "plain"])
        for name in ("plain", "options"):
            m = statistics.median(ms[spec, name])
            print(f"  {spec:5s} {name:8s} {steps[spec, name]:3d} steps  ms/token {m:7.1f} "
                  f"({m / base:.3f}x {spec} plain)  raw {[round(x, 1) for x in ms[spec, name]]}")


if __name__ == "__main__":
    main()
