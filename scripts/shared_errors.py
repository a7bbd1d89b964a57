"""Which reference words two transcribers miss, and which they miss in common.

Usage::

    python scripts/shared_errors.py A.jsonl B.jsonl [--split S]

A and B are evaluation records (``python -m kvsim.minivox.evaluate --out``,
``scripts/whisper_reference_wer.py --out``) of the same clips. Every reference word is
*missed* by a transcript when the word-level alignment of :func:`jiwer.process_words` does
not match it to an equal hypothesis word (texts normalised as :mod:`kvsim.wer` does, the
hypothesis not truncated). Per split: the share of reference words A misses, B misses and
both miss, and A's miss rate on the words B misses and on those B gets. Words both miss are
the ones neither decoder recovers from the audio; where the two mostly miss different words,
the audio carried what one of them failed to read.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import jiwer

from kvsim.wer import normalize


def missed_words(ref: str, hyp: str) -> list[bool]:
    """One flag per normalised reference word: True where the alignment matches no equal word."""
    r, h = normalize(ref), normalize(hyp)
    missed = [True] * len(r.split())
    for chunk in jiwer.process_words(r, h).alignments[0]:
        if chunk.type == "equal":
            missed[chunk.ref_start_idx:chunk.ref_end_idx] = [False] * (
                chunk.ref_end_idx - chunk.ref_start_idx)
    return missed


def read(path: Path) -> dict[tuple[str, str], dict]:
    """Records by (split, clip id); ValueError naming the file and line of a bad record."""
    from kvsim.minivox.evaluate import read_records

    return {(r["split"], r["id"]): r for r in read_records([path], ("split", "ref", "hyp"))}


def overlap(a: dict, b: dict) -> dict[str, dict[str, float]]:
    """Per split: words, and the shares missed by A, by B, by both; A's miss rate given B's."""
    if not a:
        raise ValueError("no clips to compare")
    if a.keys() != b.keys():
        raise ValueError(f"the two files hold different clips ({len(a.keys() ^ b.keys())} differ)")
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # words, A, B, both
    for key, ra in a.items():
        if ra["ref"] != b[key]["ref"]:
            raise ValueError(f"{key[1]}: the two files' references differ")
        c = counts[key[0]]
        for ma, mb in zip(missed_words(ra["ref"], ra["hyp"]), missed_words(ra["ref"], b[key]["hyp"]),
                          strict=True):
            c[0] += 1
            c[1] += ma
            c[2] += mb
            c[3] += ma and mb
    return {split: {"words": n, "a": na / n, "b": nb / n, "both": both / n,
                    "a_given_b_missed": both / nb if nb else float("nan"),
                    "a_given_b_right": (na - both) / (n - nb) if n > nb else float("nan")}
            for split, (n, na, nb, both) in counts.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--split", help="only this split")
    args = ap.parse_args(argv)
    try:
        a, b = read(args.a), read(args.b)
    except (OSError, ValueError) as e:  # the message names the file and line
        ap.error(str(e))
    if args.split:
        a = {k: v for k, v in a.items() if k[0] == args.split}
        b = {k: v for k, v in b.items() if k[0] == args.split}
    try:
        table = overlap(a, b)
    except ValueError as e:
        ap.error(f"{args.a}, {args.b}: {e}")
    print(f"{'split':<12} {'words':>7} {'A missed':>9} {'B missed':>9} {'both':>6} "
          f"{'A | B missed':>13} {'A | B right':>12}")
    for split, t in table.items():
        print(f"{split:<12} {t['words']:>7} {t['a']:>9.3f} {t['b']:>9.3f} {t['both']:>6.3f} "
              f"{t['a_given_b_missed']:>13.3f} {t['a_given_b_right']:>12.3f}")


if __name__ == "__main__":
    main()
