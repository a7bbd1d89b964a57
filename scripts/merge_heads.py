"""Merge ``kvsim calibrate`` outputs made over disjoint inputs (shards run in parallel) into one
heads.json, each weighted by its sample counts (the scores are means over samples).

Usage: python scripts/merge_heads.py OUT.json SHARD.json [SHARD.json ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvsim.trace.heads import write_heads
from kvsim.tracer.calibrate import merge_calibrations


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        scores, prov, model = merge_calibrations([Path(a) for a in argv[1:]])
    except (OSError, ValueError) as exc:
        print(f"merge_heads: {exc}", file=sys.stderr)
        return 2
    write_heads(Path(argv[0]), scores, model, prov)
    print(f"{argv[0]}: {prov['n_samples_sensitivity']} inputs ({prov['n_samples_voice']} with "
          f"aligned tokens) from {len(argv) - 1} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
