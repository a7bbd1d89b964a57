"""Trace size on disk: MB per audio minute and overhead over the raw fp16 tensor bytes.

A transcript of speech runs at roughly 3.4 tokens per second of audio (2.5 words/s, 1.35
tokens/word), so a one-minute trace has ~200 decode steps.

Usage: python benchmarks/trace_size.py [--seconds 60] [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(f"{'shape':14s} {'values':>6s} {'disk MB':>8s} {'raw MB':>8s} {'disk/raw':>8s} {'MB/audio min':>12s}")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("voxtral-mini", "qwen-omni", "minivox"):
            for values in (False, True):
                path = write_trace(Path(tmp) / f"{preset}-{values}.kvtrace", synthesize(SynthConfig(
                    preset=preset, audio_seconds=args.seconds, decode_steps=args.steps, store_values=values)))
                t = Trace(path)
                disk, raw = t.disk_bytes(), t.tensor_bytes()
                print(f"{preset:14s} {values!s:>6s} {disk / 1e6:8.1f} {raw / 1e6:8.1f} {disk / raw:8.4f} "
                      f"{disk / 1e6 / (t.audio_seconds / 60):12.1f}")


if __name__ == "__main__":
    main()
