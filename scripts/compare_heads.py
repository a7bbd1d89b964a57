"""How much two heads.json files agree (WnW App. E scores): Spearman rank correlation over the
KV-heads of the voice score (VS), the sensitivity (HS) and their product, and how many of the
top-K heads by VS x HS the two share.

Usage: python scripts/compare_heads.py A.json B.json [--top K]

K defaults to WnW's tidal-pool size at r = 0.2 on minivox (36 of 90 KV-heads).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from scipy.stats import spearmanr

from kvsim.trace.heads import HeadScores, read_heads
from kvsim.tracer.calibrate import ranking


def agreement(a: HeadScores, b: HeadScores, top: int) -> dict[str, float]:
    """Spearman over the flattened (layer, KV-head) scores, and the top-``top`` overlap."""
    if a.voice_score.shape != b.voice_score.shape:
        raise ValueError(f"shapes differ: {a.voice_score.shape} vs {b.voice_score.shape}")
    def rho(x: np.ndarray, y: np.ndarray) -> float:
        return float(spearmanr(x.ravel(), y.ravel()).statistic)

    top_a = {tuple(h) for h in ranking(a)[:top]}
    top_b = {tuple(h) for h in ranking(b)[:top]}
    return {"VS": rho(a.voice_score, b.voice_score), "HS": rho(a.sensitivity, b.sensitivity),
            "VS x HS": rho(a.importance, b.importance), f"top-{top} in common": len(top_a & top_b)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=36)
    args = ap.parse_args(argv)
    try:
        res = agreement(read_heads(args.a), read_heads(args.b), args.top)
    except (OSError, ValueError) as exc:
        print(f"compare_heads: {exc}", file=sys.stderr)
        return 2
    print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
