"""Corpus WER of every method of a live run folder (or of several minivox evaluations)
against one baseline, paired by clip, with clip-bootstrap 95% intervals of the difference.

Every method of a ``kvsim live`` folder (or study ``live`` folder) decoded the same clips (a
method: a label at one budget, ``snapkv@0.2``, when the folder holds it at several),
so the difference of two methods' corpus WER (errors over reference words, summed over
clips, WnW §3.5) is resampled over clips, the same clips for both sides: this says whether
a method differs from the baseline by more than the choice of clips. The ``--out`` files of
``python -m kvsim.minivox.evaluate`` (one adapter each, named by the file) pair the same way;
with ``--by-split`` each split of each file is a method (``FILE:SPLIT``) and clips pair by
their number, which pairs a split with its re-spoken twins (clip i of ``test_new_train_voice``
reads clip i of ``test_new``).

Usage: python scripts/live_paired_wer.py RUN_FOLDER_OR_RUNS_PARQUET --baseline SUBSTRING
       python scripts/live_paired_wer.py EVAL_A.jsonl EVAL_B.jsonl ... --baseline SUBSTRING
       python scripts/live_paired_wer.py EVAL.jsonl --by-split --baseline EVAL:test_new
       python scripts/live_paired_wer.py A.jsonl B.jsonl --by-split --baseline B:test_new \
           --contrast A:test_new A:test_new_train_both B:test_new B:test_new_train_both
       python scripts/live_paired_wer.py P9.jsonl C9.jsonl P10.jsonl C10.jsonl --by-split \
           --baseline C9:test_new --mean-difference P9:test_new C9:test_new P10:test_new C10:test_new
       [--n-boot 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from kvsim.studies.fidelity_stats import Interval, bootstrap, bootstrap_draws


def paired_table(runs: pl.DataFrame, baseline: str, n_boot: int = 10000, seed: int = 0) -> pl.DataFrame:
    """One row per method label: its corpus WER, the difference to the method whose label
    is ``baseline`` (or, where none is, the one label containing it) and that difference's
    clip-bootstrap 95% interval."""
    runs = method_labels(runs)
    labels = sorted(set(runs["label"].to_list()))
    base = [lab for lab in labels if lab == baseline] or [lab for lab in labels if baseline in lab]
    if len(base) != 1:
        raise ValueError(f"--baseline {baseline!r} matches {len(base)} methods (need 1): {', '.join(base)}")
    errors, words = clip_counts(runs, labels)
    n = len(next(iter(errors.values())))
    draws = bootstrap_draws(n, n_boot, seed)
    wer = corpus_wer(errors, words)

    out = []
    for lab in labels:
        diff = bootstrap(lambda d, lab=lab: wer(lab, d) - wer(base[0], d), n, draws)
        out.append({"label": lab, "clips": n, "wer": wer(lab, np.arange(n)),
                    "diff": diff.value, "diff_low": diff.low, "diff_high": diff.high})
    return pl.DataFrame(out)


def corpus_wer(errors: dict, words: dict) -> Callable[[str, np.ndarray], float]:
    """``wer(label, draw)``: the corpus WER of a label over the clips of one resample."""
    def wer(lab: str, d: np.ndarray) -> float:
        return float(errors[lab][d].sum() / words[lab][d].sum())
    return wer


def clip_counts(runs: pl.DataFrame, labels: list[str]) -> tuple[dict, dict]:
    """Each label's errors and reference words per clip, in one clip order for all (every
    label must have decoded every clip: the pairing needs all)."""
    clips = sorted(set(runs["input"].to_list()))
    errors, words = {}, {}
    for lab in labels:
        rows = runs.filter(pl.col("label") == lab).sort("input")
        if rows["input"].to_list() != clips:
            raise ValueError(f"{lab}: decoded {rows.height} of the {len(clips)} clips; the pairing needs all")
        errors[lab] = rows["wer_errors"].to_numpy().astype(np.float64)
        words[lab] = rows["ref_words"].to_numpy().astype(np.float64)
    return errors, words


def _paired_wer(runs: pl.DataFrame, labels: list[str], option: str) -> tuple[Callable, int]:
    """The corpus-WER function of :func:`corpus_wer` over ``labels`` and the number of clips;
    ValueError naming ``option`` for a label that is no method."""
    runs = method_labels(runs)
    known = set(runs["label"].to_list())
    for lab in labels:
        if lab not in known:
            raise ValueError(f"{option}: no method {lab!r} (methods: {', '.join(sorted(known))})")
    errors, words = clip_counts(runs, list(dict.fromkeys(labels)))
    return corpus_wer(errors, words), len(errors[labels[0]])


def contrast(runs: pl.DataFrame, labels: tuple[str, str, str, str], n_boot: int = 10000,
             seed: int = 0) -> Interval:
    """``(A - B) - (C - D)`` of the corpus WERs of methods ``labels`` = (A, B, C, D), with its
    clip-bootstrap 95% interval: the same clips resampled for all four, so that one arm's gap
    between a split and its re-spoken twin is compared with another arm's (a difference in
    differences). Returns the ``bootstrap`` estimate (``value``, ``low``, ``high``)."""
    wer, n = _paired_wer(runs, list(labels), "--contrast")
    a, b, c, d_ = labels
    return bootstrap(lambda d: (wer(a, d) - wer(b, d)) - (wer(c, d) - wer(d_, d)), n,
                     bootstrap_draws(n, n_boot, seed))


def mean_difference(runs: pl.DataFrame, labels: list[str], n_boot: int = 10000,
                    seed: int = 0) -> Interval:
    """The mean over pairs of ``A_i - B_i`` (``labels`` = A1, B1, A2, B2, ...) of corpus WERs,
    with its clip-bootstrap 95% interval, the same clips resampled for every pair: one arm
    against another over several training seeds (A_i, B_i the two arms at seed i). The
    interval is over clips only; the seeds' spread is in the pairs' own differences."""
    if not labels or len(labels) % 2:
        raise ValueError(f"--mean-difference: pairs A B, got {len(labels)} labels")
    wer, n = _paired_wer(runs, labels, "--mean-difference")
    pairs = list(zip(labels[::2], labels[1::2], strict=True))
    return bootstrap(lambda d: sum(wer(a, d) - wer(b, d) for a, b in pairs) / len(pairs), n,
                     bootstrap_draws(n, n_boot, seed))


def method_labels(runs: pl.DataFrame) -> pl.DataFrame:
    """``runs`` with each label that a grid decoded at several budgets split into one method
    per budget (``snapkv@0.2``, ``snapkv@0.4``, ...); a label with one budget (``full``, WnW's
    per-budget ``wnw(lam=...)``) keeps its name."""
    if "budget" not in runs.columns:
        return runs
    several = runs.group_by("label").agg(pl.col("budget").n_unique().alias("n"))
    several = set(several.filter(pl.col("n") > 1)["label"].to_list())
    tagged = [f"{lab}@{b:g}" if lab in several else lab
              for lab, b in zip(runs["label"], runs["budget"], strict=True)]
    return runs.with_columns(pl.Series("label", tagged))


def evaluation_runs(files: list[Path], by_split: bool = False) -> pl.DataFrame:
    """The ``--out`` records of ``kvsim.minivox.evaluate`` as runs (label: the file's stem;
    ``by_split``: ``stem:split``, the clip: its number within its split); records written
    before they carried ``errors`` are re-scored from their text with minivox's tokenizer, as
    the evaluation scored them (token-truncated WER, WnW §3.5)."""
    from kvsim.minivox.evaluate import read_records

    tokenizer, rows = None, []
    for f in files:
        for rec in read_records([f], ("split",)):
            if "errors" not in rec:
                from kvsim.minivox import load_processor, minivox_dir
                from kvsim.wer import truncated_wer

                tokenizer = tokenizer or load_processor(minivox_dir()).tokenizer
                scores = truncated_wer(rec["hyp"], rec["ref"], tokenizer)
                rec["errors"], rec["ref_words"] = scores.errors, scores.ref_words
            if by_split:
                clip, label = rec["id"].rpartition("-")[2], f"{f.stem}:{rec['split']}"
            else:
                clip, label = f"{rec['split']}/{rec['id']}", f.stem
            rows.append({"input": clip, "label": label,
                         "wer_errors": rec["errors"], "ref_words": rec["ref_words"]})
    return pl.DataFrame(rows)


def read_runs(paths: list[Path], by_split: bool = False) -> pl.DataFrame:
    """A run folder or runs.parquet, or several evaluation ``.jsonl`` files (``by_split``:
    one method per file and split, clips paired by number)."""
    if all(p.suffix == ".jsonl" for p in paths):
        return evaluation_runs(paths, by_split)
    if by_split:
        raise ValueError("--by-split pairs evaluation .jsonl files only")
    if len(paths) != 1:
        raise ValueError("give one run folder (or runs.parquet), or evaluation .jsonl files only")
    return pl.read_parquet(paths[0] / "runs.parquet" if paths[0].is_dir() else paths[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--baseline", required=True,
                    help="a method label, or a substring of exactly one")
    ap.add_argument("--by-split", action="store_true",
                    help="evaluation files: each split a method (FILE:SPLIT), clips paired by "
                    "their number (a split against its re-spoken twins)")
    ap.add_argument("--contrast", nargs=4, metavar=("A", "B", "C", "D"),
                    help="also print (A - B) - (C - D) with its paired interval: one arm's gap "
                    "between a split and its twin against another's")
    ap.add_argument("--mean-difference", nargs="+", metavar="A B",
                    help="also print the mean of A1 - B1, A2 - B2, ... with its paired "
                    "interval: two arms over several training seeds")
    ap.add_argument("--n-boot", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    where = ", ".join(map(str, a.runs))
    try:
        runs = read_runs(a.runs, a.by_split)
        table = paired_table(runs, a.baseline, a.n_boot, a.seed)
        gap = contrast(runs, tuple(a.contrast), a.n_boot, a.seed) if a.contrast else None
        mean = (mean_difference(runs, a.mean_difference, a.n_boot, a.seed)
                if a.mean_difference else None)
    except (OSError, ValueError, KeyError, json.JSONDecodeError, pl.exceptions.PolarsError) as exc:
        print(f"{where}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    with pl.Config(tbl_rows=-1, fmt_str_lengths=90, tbl_width_chars=200):
        print(table)
    if gap is not None:
        A, B, C, D = a.contrast
        print(f"({A} - {B}) - ({C} - {D}): {gap.value:+.4f} [{gap.low:+.4f}, {gap.high:+.4f}]")
    if mean is not None:
        pairs = a.mean_difference
        terms = ", ".join(f"{x} - {y}" for x, y in zip(pairs[::2], pairs[1::2], strict=True))
        print(f"mean of ({terms}): {mean.value:+.4f} [{mean.low:+.4f}, {mean.high:+.4f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
