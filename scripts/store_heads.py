"""Store a calibration file (heads.json) in existing traces, replacing the scores they hold.

``kvsim trace --heads FILE`` stores a calibration when a trace is written; this does it
afterwards (after a recalibration), rewriting each trace atomically with the same keys,
queries, values and positions. A trace whose shape does not match the calibration is reported
in one line and left as it was; the others go on.

Usage: python scripts/store_heads.py --heads heads.json TRACE.kvtrace [...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvsim.trace.heads import read_heads
from kvsim.trace.schema import TraceError
from kvsim.tracer.calibrate import store_in_trace


def store(trace: Path, heads: Path) -> str:
    """Store ``heads`` in ``trace``; returns a one-line summary (ValueError when it does not fit)."""
    scores = read_heads(heads)
    store_in_trace(trace, scores)
    return f"{trace}: stored {heads} ({scores.source})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=Path, required=True)
    ap.add_argument("traces", nargs="+", type=Path)
    args = ap.parse_args(argv)
    failed = 0
    for trace in args.traces:
        try:
            print(store(trace, args.heads))
        except (OSError, ValueError, TraceError) as exc:
            print(f"store_heads: {str(exc).splitlines()[0]}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
