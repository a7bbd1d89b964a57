"""Weight-average minivox adapters of one lineage into one adapter (a "model soup").

Usage::

    python scripts/minivox_soup.py A.safetensors B.safetensors [...] --out SOUP.safetensors \
        [--weights 0.5,0.5]

Projector weights are averaged; the LoRA updates are averaged exactly by concatenating the
factors (the soup's LoRA rank is the sum of the parts' ranks). See
:func:`kvsim.minivox.build.average_adapters`.
"""

from __future__ import annotations

import argparse

from kvsim.minivox.build import average_adapters


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapters", nargs="+", help="adapter .safetensors files (at least two)")
    ap.add_argument("--out", required=True, help="output adapter (float16)")
    ap.add_argument("--weights", help="comma-separated weights summing to 1 (default: uniform)")
    a = ap.parse_args(argv)
    w = [float(x) for x in a.weights.split(",")] if a.weights else None
    try:
        print(average_adapters(a.adapters, a.out, weights=w))
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))


if __name__ == "__main__":
    main()
