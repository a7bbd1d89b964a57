"""Where minivox's transcription errors are: substitutions, deletions and insertions per
reference word, and how many of the deleted (inserted) words fall in long runs, i.e. skipped
passages (loops).

Reads the ``--out`` files of ``python -m kvsim.minivox.evaluate``. The counts are over the
normalised texts (:func:`kvsim.wer.normalize`) without truncation, so the three rates add up
to the untruncated WER, which is at least the truncated one the evaluation reports.

Usage: python scripts/minivox_error_kinds.py EVAL.jsonl [EVAL.jsonl ...] [--run-words 10]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import jiwer

from kvsim.wer import normalize


def error_kinds(refs: Sequence[str], hyps: Sequence[str], run_words: int = 10) -> dict:
    """Edit operations of ``hyps`` against ``refs`` pooled over the pairs, as shares of the
    reference words; ``skipped`` / ``looped``: the deleted / inserted words that lie in runs
    of at least ``run_words`` consecutive words."""
    ops = dict.fromkeys(("substitute", "delete", "insert"), 0)
    skipped = looped = n_ref = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        ref, hyp = normalize(ref), normalize(hyp)
        n_ref += len(ref.split())
        for chunk in jiwer.process_words(ref, hyp).alignments[0]:
            if chunk.type not in ops:
                continue
            n = max(chunk.ref_end_idx - chunk.ref_start_idx, chunk.hyp_end_idx - chunk.hyp_start_idx)
            ops[chunk.type] += n
            if n >= run_words and chunk.type == "delete":
                skipped += n
            if n >= run_words and chunk.type == "insert":
                looped += n
    return {"ref_words": n_ref, **{k: v / n_ref for k, v in ops.items()},
            "wer": sum(ops.values()) / n_ref, "skipped": skipped / n_ref, "looped": looped / n_ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evals", nargs="+", type=Path)
    ap.add_argument("--run-words", type=int, default=10)
    args = ap.parse_args()
    print(f"file\twords\tsub\tdel\tins\tWER\tdel in runs >= {args.run_words}\tins in runs >= {args.run_words}")
    for path in args.evals:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        k = error_kinds([r["ref"] for r in rows], [r["hyp"] for r in rows], args.run_words)
        print(f"{path.name}\t{k['ref_words']}\t{k['substitute']:.3f}\t{k['delete']:.3f}\t"
              f"{k['insert']:.3f}\t{k['wer']:.3f}\t{k['skipped']:.3f}\t{k['looped']:.3f}")


if __name__ == "__main__":
    main()
