"""Where a minivox evaluation loses its words: corpus WER by speaking-rate band (or voice), and
the rank correlation of the per-clip WER with the speaking rate and with the clip's duration.

Usage: python scripts/wer_by_condition.py EVAL.jsonl [...] --manifest D/manifest.parquet
       [--by rate|voice] [--bands 160,180]

EVAL.jsonl: the ``--out`` files of ``python -m kvsim.minivox.evaluate`` (one record per clip
with ``id``, ``errors`` and ``ref_words``); the manifest gives each clip's ``rate`` (espeak
words per minute), ``voice`` and ``duration``. ``--bands 160,180`` splits the rates into
< 160, 160-179 and >= 180 words per minute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl
from scipy.stats import spearmanr

from kvsim.minivox.evaluate import read_records
from kvsim.wer import average_wer

FIELDS = ("id", "errors", "ref_words")


def read_evaluations(files: list[Path]) -> pl.DataFrame:
    """One row per clip record; ValueError naming the file, line and field of a bad record."""
    rows = [{f: rec[f] for f in FIELDS} for rec in read_records(files, FIELDS)]
    if not rows:
        raise ValueError(f"{', '.join(map(str, files))}: no clip records")
    return pl.DataFrame(rows)


def rate_band(rate: int, edges: list[int]) -> str:
    """The label of the band of ``rate`` between sorted ``edges`` (words per minute)."""
    lows = [None, *edges]
    highs = [*edges, None]
    for low, high in zip(lows, highs, strict=True):
        if (low is None or rate >= low) and (high is None or rate < high):
            return f"< {high}" if low is None else f">= {low}" if high is None else f"{low}-{high - 1}"
    raise AssertionError("unreachable: the bands cover every rate")


def breakdown(clips: pl.DataFrame, by: str, edges: list[int]) -> pl.DataFrame:
    """Clips, corpus WER and the rates each group holds, one row per group."""
    key = (clips["rate"].map_elements(lambda r: rate_band(r, edges), return_dtype=pl.String)
           if by == "rate" else clips[by])
    groups = clips.with_columns(key.alias("group")).group_by("group", maintain_order=True)
    out = groups.agg(pl.len().alias("clips"), pl.col("errors"), pl.col("ref_words"),
                     pl.col("rate").min().alias("rate_min"), pl.col("rate").max().alias("rate_max"))
    wer = [average_wer(e, w) for e, w in zip(out["errors"], out["ref_words"], strict=True)]
    return (out.with_columns(pl.Series("corpus_wer", wer)).drop("errors", "ref_words")
            .sort("rate_min"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evaluations", nargs="+", type=Path)
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--by", choices=("rate", "voice"), default="rate")
    ap.add_argument("--bands", default="160,180")
    args = ap.parse_args(argv)
    try:
        edges = sorted(int(x) for x in args.bands.split(","))
        clips = read_evaluations(args.evaluations)
        manifest = pl.read_parquet(args.manifest, columns=["id", "rate", "voice", "duration"])
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    clips = clips.join(manifest, on="id", how="left")
    unknown = clips.filter(pl.col("rate").is_null())["id"].to_list()
    if unknown:
        print(f"error: {args.manifest}: no clip {unknown[0]!r} ({len(unknown)} unknown)", file=sys.stderr)
        return 2
    clips = clips.with_columns((pl.col("errors") / pl.col("ref_words")).alias("wer"))
    with pl.Config(tbl_rows=-1):
        print(breakdown(clips, args.by, edges))
    for column in ("rate", "duration"):
        res = spearmanr(clips[column], clips["wer"])
        print(f"Spearman(per-clip WER, {column}) over {len(clips)} clips: "
              f"{res.statistic:+.3f} (p = {res.pvalue:.3f})")
    print(f"corpus WER {average_wer(clips['errors'], clips['ref_words']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
