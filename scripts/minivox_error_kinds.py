"""Where minivox's transcription errors are: substitutions, deletions and insertions per
reference word, how many of the deleted (inserted) words fall in long runs, i.e. skipped
passages (loops), the substitutions among the words outside skipped passages (how well the
passages read were read, whatever was skipped) and how near those misses are in characters,
and how many output words are wrong: overall and just before each skip.

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
import numpy as np

from kvsim.wer import normalize


def is_skip(chunk, run_words: int) -> bool:
    """Whether a jiwer alignment chunk is a skipped passage: ``run_words`` or more reference
    words deleted in a row."""
    return chunk.type == "delete" and chunk.ref_end_idx - chunk.ref_start_idx >= run_words


def read_words(ref: str, hyp: str, run_words: int = 10) -> list[tuple[str, bool]]:
    """The normalised reference words outside skipped passages (:func:`is_skip`), each with
    whether it was substituted."""
    ref, hyp = normalize(ref), normalize(hyp)
    words = ref.split()
    return [(words[k], chunk.type == "substitute")
            for chunk in jiwer.process_words(ref, hyp).alignments[0]
            if not is_skip(chunk, run_words)
            for k in range(chunk.ref_start_idx, chunk.ref_end_idx)]


def error_kinds(refs: Sequence[str], hyps: Sequence[str], run_words: int = 10) -> dict:
    """Edit operations of ``hyps`` against ``refs`` pooled over the pairs, as shares of the
    reference words; ``skipped`` / ``looped``: the deleted / inserted words that lie in runs
    of at least ``run_words`` consecutive words; ``misread``: the substitutions over the
    reference words outside those skipped runs; ``misread_chars``: the character error rate
    of the substituted words against the words written in their place (how near the misses
    are: a word spelled as it sounds is near, another word far); ``wrong_output``: the share
    of output words substituted or inserted; ``wrong_before_skips``: that share over the ``run_words`` output
    words before each skip (skips with fewer output words before them left out; NaN
    without any)."""
    ops = dict.fromkeys(("substitute", "delete", "insert"), 0)
    skipped = looped = n_ref = 0
    wrong, before = [], []
    misread: list[tuple[str, str]] = []  # (reference word, the word written for it)
    for ref, hyp in zip(refs, hyps, strict=True):
        ref, hyp = normalize(ref), normalize(hyp)
        n_ref += len(ref.split())
        flags: list[bool] = []  # per output word: substituted or inserted
        for chunk in jiwer.process_words(ref, hyp).alignments[0]:
            n = max(chunk.ref_end_idx - chunk.ref_start_idx, chunk.hyp_end_idx - chunk.hyp_start_idx)
            if chunk.type == "substitute":
                misread += zip(ref.split()[chunk.ref_start_idx:chunk.ref_end_idx],
                               hyp.split()[chunk.hyp_start_idx:chunk.hyp_end_idx], strict=True)
            if chunk.type == "delete":
                if is_skip(chunk, run_words):
                    skipped += n
                    if len(flags) >= run_words:
                        before.append(np.mean(flags[-run_words:]))
            else:
                flags += [chunk.type != "equal"] * n
            if chunk.type == "insert" and n >= run_words:
                looped += n
            if chunk.type in ops:
                ops[chunk.type] += n
        wrong += flags
    return {"ref_words": n_ref, **{k: v / n_ref for k, v in ops.items()},
            "wer": sum(ops.values()) / n_ref, "skipped": skipped / n_ref, "looped": looped / n_ref,
            "misread": ops["substitute"] / (n_ref - skipped) if n_ref > skipped else float("nan"),
            "misread_chars": (jiwer.cer([r for r, _ in misread], [h for _, h in misread])
                              if misread else float("nan")),
            "wrong_output": float(np.mean(wrong)) if wrong else float("nan"),
            "wrong_before_skips": float(np.mean(before)) if before else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evals", nargs="+", type=Path)
    ap.add_argument("--run-words", type=int, default=10)
    args = ap.parse_args()
    n = args.run_words
    print(f"file\twords\tsub\tdel\tins\tWER\tdel in runs >= {n}\tins in runs >= {n}"
          f"\tsub of words not in those\tchar errors of the subs\toutput words wrong"
          f"\tof the {n} before a skip")
    for path in args.evals:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        k = error_kinds([r["ref"] for r in rows], [r["hyp"] for r in rows], args.run_words)
        print(f"{path.name}\t{k['ref_words']}\t{k['substitute']:.3f}\t{k['delete']:.3f}\t"
              f"{k['insert']:.3f}\t{k['wer']:.3f}\t{k['skipped']:.3f}\t{k['looped']:.3f}\t"
              f"{k['misread']:.3f}\t{k['misread_chars']:.3f}\t{k['wrong_output']:.3f}\t"
              f"{k['wrong_before_skips']:.3f}")


if __name__ == "__main__":
    main()
