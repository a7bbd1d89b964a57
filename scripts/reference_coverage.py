"""How far into the reference a transcript reads: matched reference words per tenth of it.

For each run of a live grid (a ``table5_runs.parquet`` or ``runs.parquet``; a folder holding
one) or each record of ``python -m kvsim.minivox.evaluate --out`` files, the hypothesis is
aligned to the reference (jiwer, normalised as the WER is) and the reference words it matches
are counted in each tenth of the reference. A run that reads in order and to the end matches
words in every tenth; one that ends early matches none after the tenth where it stopped; one
that skips a passage has a gap in the middle. This tells an early end from a skip or a loop
where the WER alone does not.

Usage: python scripts/reference_coverage.py RUNS.parquet [--inputs ID,ID] [--labels L,L]
       python scripts/reference_coverage.py EVAL.jsonl [...] [--inputs ID,ID]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jiwer
import polars as pl

from kvsim.wer import normalize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_paired_wer import method_labels  # noqa: E402  (one definition of a method's label)

TENTHS = 10


def matched_by_tenth(ref: str, hyp: str, parts: int = TENTHS) -> list[int]:
    """Reference words the hypothesis matches (jiwer alignment of the normalised texts), counted
    in each of ``parts`` equal stretches of the reference."""
    ref_n, hyp_n = normalize(ref), normalize(hyp)
    n = len(ref_n.split())
    counts = [0] * parts
    if n == 0 or not hyp_n.split():
        return counts
    for chunk in jiwer.process_words(ref_n, hyp_n).alignments[0]:
        if chunk.type == "equal":
            for i in range(chunk.ref_start_idx, chunk.ref_end_idx):
                counts[min(parts - 1, i * parts // n)] += 1
    return counts


def read_rows(path: Path) -> pl.DataFrame:
    """(input, label, reference, hypothesis, wer) of a runs parquet (or a folder holding
    ``table5_runs.parquet`` or ``runs.parquet``) or of an evaluation ``.jsonl`` (label: its stem)."""
    if path.suffix == ".jsonl":
        from kvsim.minivox.evaluate import read_records

        recs = read_records([path], ("ref", "hyp", "wer"))
        return pl.DataFrame({"input": [r["id"] for r in recs], "label": [path.stem] * len(recs),
                             "reference": [r["ref"] for r in recs],
                             "hypothesis": [r["hyp"] for r in recs],
                             "wer": [float(r["wer"]) for r in recs]})
    if path.is_dir():
        found = [p for p in (path / "table5_runs.parquet", path / "runs.parquet") if p.is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: no table5_runs.parquet or runs.parquet in it")
        path = found[0]
    runs = pl.read_parquet(path)
    missing = {"input", "label", "reference", "hypothesis", "wer"} - set(runs.columns)
    if missing:
        raise ValueError(f"{path}: no column {', '.join(sorted(missing))}")
    return method_labels(runs).select("input", "label", "reference", "hypothesis", "wer")


def coverage_table(runs: pl.DataFrame) -> pl.DataFrame:
    """One row per run (``source``: the file it came from, where ``runs`` has that column):
    its WER, reference words, words matched and matched per tenth."""
    rows = []
    if "source" not in runs.columns:
        runs = runs.with_columns(pl.lit("").alias("source"))
    for r in runs.sort("input", "label", "source").iter_rows(named=True):
        tenths = matched_by_tenth(r["reference"], r["hypothesis"])
        rows.append({"input": r["input"], "label": r["label"], "source": r["source"],
                     "wer": round(r["wer"], 3),
                     "ref_words": len(normalize(r["reference"]).split()),
                     "matched": sum(tenths), "by_tenth": " ".join(f"{c:3d}" for c in tenths)})
    return pl.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--inputs", default=None, help="only these clips (comma-separated)")
    ap.add_argument("--labels", default=None, help="only these labels (comma-separated)")
    a = ap.parse_args(argv)
    try:
        runs = pl.concat([read_rows(p).with_columns(pl.lit(p.stem if p.suffix else p.name).alias("source"))
                          for p in a.paths], how="vertical_relaxed")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.inputs:
        runs = runs.filter(pl.col("input").is_in(a.inputs.split(",")))
    if a.labels:
        runs = runs.filter(pl.col("label").is_in(a.labels.split(",")))
    with pl.Config(tbl_rows=-1, fmt_str_lengths=60, tbl_width_chars=200,
                   tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(coverage_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
