"""Merge several ``kvsim live -o DIR`` outputs (e.g. shards of a dataset run in parallel
processes) into one results table, chart and markdown table.

Usage: python scripts/merge_live.py OUT_DIR RUN_DIR [RUN_DIR ...]

Writes OUT_DIR/runs.parquet (every run), OUT_DIR/results.parquet (one row per method and
budget: means over inputs, termination rate), OUT_DIR/wer_vs_rgpu.{html,png}, and prints the
Table 5 layout: WER per method (rows) and target r_GPU (columns), with measured r_GPU,
r_GPU+CPU and termination rate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from kvsim.live.run import aggregate, wer_chart, with_method
from kvsim.plots import save_chart
from kvsim.trace.atomic import atomic_file


def markdown(results: pl.DataFrame) -> str:
    budgets = sorted(b for b in results["budget"].unique().to_list() if b < 1.0)
    lines = ["| method | " + " | ".join(f"r = {b:g}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    rows: dict[str, dict[float, str]] = {}
    for r in with_method(results).iter_rows(named=True):
        cell = (f"{r['wer']:.3f} ({r['r_gpu_vs_original']:.2f} / {r['r_gpu_cpu']:.2f}, "
                f"{r['termination_rate']:.0%})")
        rows.setdefault(r["method"], {})[r["budget"]] = cell
    for name, cells in rows.items():
        if set(cells) == {1.0}:  # full attention: one budget
            lines.append(f"| {name} | " + " | ".join([cells[1.0]] + [""] * (len(budgets) - 1)) + " |")
        else:
            lines.append(f"| {name} | " + " | ".join(cells.get(b, "-") for b in budgets) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    out, dirs = Path(argv[0]), [Path(d) for d in argv[1:]]
    missing = [d / "runs.parquet" for d in dirs if not (d / "runs.parquet").is_file()]
    if missing:
        sys.exit(f"missing: {', '.join(map(str, missing))}")
    runs = pl.concat([pl.read_parquet(d / "runs.parquet") for d in dirs], how="diagonal_relaxed")
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "runs.parquet") as tmp:
        runs.write_parquet(tmp)
    results = aggregate(runs)
    with atomic_file(out / "results.parquet") as tmp:
        results.write_parquet(tmp)
    save_chart(wer_chart(results), out / "wer_vs_rgpu")
    n_inputs = runs["input"].n_unique()
    print(f"{runs.height} runs over {n_inputs} inputs; mean WER over inputs, "
          "(measured r_GPU / r_GPU+CPU, termination rate)")
    print(markdown(results))


if __name__ == "__main__":
    main(sys.argv[1:])
