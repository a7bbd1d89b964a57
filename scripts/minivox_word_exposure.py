"""How well minivox reads a word, by how often training transcripts had it.

For each evaluation file, the reference words outside skipped passages (the words
``minivox_error_kinds.py``'s "sub of words not in those" counts) are grouped by the number of
times the word occurs in the transcripts of the training splits named by ``--heard``, and
each group's misread rate (substituted words over the group's words) is printed. A reader
that has learnt the sounds of words reads a word it never heard in training about as well as
one it heard often; one that maps each word's sound to that word's token misreads the words
it heard rarely.

Usage: python scripts/minivox_word_exposure.py EVAL.jsonl [EVAL.jsonl ...]
       [--manifest data/minivox/manifest.parquet] [--heard train,train_long,train_wide,train_longform]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvsim.wer import normalize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minivox_error_kinds import read_words  # noqa: E402  (the one definition of a skip)

# the shipped adapter's lineage heard these splits' transcripts (minivox/MODEL_CARD.md)
SHIPPED_HEARD = "train,train_long,train_wide,train_longform"
EDGES = (1, 10, 100)  # groups: 0, 1-9, 10-99, 100 or more


def heard_counts(texts: Iterable[str]) -> Counter:
    """Occurrences of each normalised word in ``texts``."""
    return Counter(w for text in texts for w in normalize(text).split())


def group_of(count: int, edges: Sequence[int] = EDGES) -> str:
    """The exposure group of a word heard ``count`` times: "0", "1-9", "10-99", "100+"."""
    lows = (0, *edges)
    for lo, hi in zip(lows, (*edges, None), strict=True):
        if hi is None or count < hi:
            return f"{lo}+" if hi is None else (str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")
    raise AssertionError("unreachable")


def misread_by_exposure(records: Iterable[dict], heard: Counter, run_words: int = 10,
                        edges: Sequence[int] = EDGES) -> dict[str, tuple[int, float]]:
    """Per exposure group (in order): the number of reference words read and the share of
    them substituted, over the ``ref`` / ``hyp`` pairs of ``records``."""
    groups = [group_of(c, edges) for c in (0, *edges)]
    seen, wrong = Counter(), Counter()
    for r in records:
        for word, substituted in read_words(r["ref"], r["hyp"], run_words):
            g = group_of(heard[word], edges)
            seen[g] += 1
            wrong[g] += substituted
    return {g: (seen[g], wrong[g] / seen[g] if seen[g] else float("nan")) for g in groups}


def main() -> None:
    import polars as pl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evals", nargs="+", type=Path)
    ap.add_argument("--manifest", type=Path, default=Path("data/minivox/manifest.parquet"))
    ap.add_argument("--heard", default=SHIPPED_HEARD,
                    help="comma-separated training splits whose transcripts count as heard")
    ap.add_argument("--run-words", type=int, default=10)
    args = ap.parse_args()
    splits = args.heard.split(",")
    manifest = pl.read_parquet(args.manifest, columns=["split", "text"])
    missing = sorted(set(splits) - set(manifest["split"].unique()))
    if missing:
        raise SystemExit(f"error: {args.manifest}: no split {', '.join(missing)} (--heard)")
    heard = heard_counts(manifest.filter(pl.col("split").is_in(splits))["text"])
    groups = [group_of(c) for c in (0, *EDGES)]
    print("file\t" + "\t".join(f"heard {g}: words\tmisread" for g in groups))
    for path in args.evals:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        table = misread_by_exposure(rows, heard, args.run_words)
        print(path.name + "".join(f"\t{n}\t{rate:.3f}" for n, rate in table.values()))


if __name__ == "__main__":
    main()
