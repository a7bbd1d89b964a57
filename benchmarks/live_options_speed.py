"""Live decoding ms/token with the decoding options (read window + cycle ban) against without.

``full`` and ``wnw`` decode one long-form minivox clip from one shared prefill, each with and
without ``--read-window 2,3,8 --ban-cycles 16,3``, alternating (full, full+options, wnw,
wnw+options, full, ...) so that machine load hits them alike; medians over the rounds. The
options' cost is the four aligning layers' float32 softmax over the context (computed beside
sdpa to move the read position) and the ban's scan of the last tokens. Both runs of a pair
stop at the same token count (``--tokens``), so the figure compares like with like even where
the options change the tokens.

Usage: python benchmarks/live_options_speed.py [--data /work/data/minivox] [--split test_long]
       [--clip 7] [--tokens 32] [--rounds 3] [--budget 0.2]
"""

from __future__ import annotations

import statistics

from _minivox_clip import HEADS, clip_options, prefilled_clip

from kvsim.decoding.cycle_ban import CycleBanConfig
from kvsim.decoding.read_window import ReadWindowConfig
from kvsim.live.decode import LiveConfig, live_generate
from kvsim.policies.spec import PolicySpec
from kvsim.trace.heads import read_heads


def main() -> None:
    args = clip_options("test_long", clip=7, tokens=32, rounds=3).parse_args()
    lm, item, prompt, prefilled = prefilled_clip(args)
    plain = LiveConfig(max_new_tokens=args.tokens, head_scores=read_heads(HEADS))
    with_options = LiveConfig(max_new_tokens=args.tokens, head_scores=plain.head_scores,
                              read_window=ReadWindowConfig.parse("2,3,8"),
                              ban_cycles=CycleBanConfig.parse("16,3"))
    runs = [(spec, name, cfg) for spec in (PolicySpec("full", 1.0), PolicySpec("wnw", args.budget))
            for name, cfg in (("plain", plain), ("options", with_options))]
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
