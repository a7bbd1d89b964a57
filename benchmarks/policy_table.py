"""The policy comparison table: every policy x r_GPU in {0.2, 0.4, 0.6, 0.8} on the shipped
traces (means over the traces each ran on; column traces), printed, written into docs/results/policy-table.md between the
``<!-- policy-table:start -->`` / ``<!-- policy-table:end -->`` markers, and the chart to
docs/figures/policy_recall.{html,png}.

Usage: python benchmarks/policy_table.py [TRACES...]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import polars as pl  # noqa: E402

from kvsim.plots import recall_vs_rgpu, save_chart  # noqa: E402
from kvsim.policies import registry  # noqa: E402
from kvsim.replay.engine import PolicySpec, ReplayConfig, Replayer  # noqa: E402
from kvsim.results import markdown_table  # noqa: E402
from kvsim.specs import default_trace_dir  # noqa: E402
from kvsim.trace import Trace, find_traces  # noqa: E402
from kvsim.trace.atomic import atomic_write_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (0.2, 0.4, 0.6, 0.8)
COLUMNS = [
    ("label", "policy", "{}"),
    ("budget", "target r", "{:.1f}"),
    ("traces", "traces", "{:d}"),
    ("r_gpu", "r_GPU", "{:.3f}"),
    ("r_gpu_cpu", "r_GPU+CPU", "{:.3f}"),
    ("read_fraction", "read", "{:.3f}"),
    ("attn_recall", "attn recall", "{:.3f}"),
    ("output_error", "out err", "{:.3f}"),
    ("topk_jaccard", "top-100 J", "{:.3f}"),
    ("h2d_mb_per_step", "CPU→GPU MB/step", "{:.4f}"),
    ("transfers_per_step", "copies/step", "{:.1f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*")
    args = ap.parse_args()
    paths = find_traces(args.traces or [default_trace_dir()])
    names = [n for n in registry.available() if not n.startswith("_")]
    specs = [PolicySpec(n, b) for b in BUDGETS for n in names]
    t0 = time.perf_counter()
    rows, refused = [], []
    for p in paths:
        rep = Replayer(Trace(p), ReplayConfig())
        rows += [r.summary for r in rep.run(specs)]
        refused += [f"{p.name}: {s.label}@{s.budget:g}: {why}" for s, why in rep.failures]
    wall = time.perf_counter() - t0
    frame = pl.DataFrame(rows)
    numeric = [c for c, _, _ in COLUMNS if c not in ("label", "budget", "traces")]
    table = (frame.group_by("policy", "label", "budget")
             .agg(pl.len().alias("traces"), *[pl.col(c).mean() for c in numeric])
             .sort("budget", "policy"))
    md = markdown_table(table, COLUMNS)
    cmd = "python benchmarks/policy_table.py"
    note = (f"{len(paths)} trace(s): {', '.join(p.name for p in paths)}; {len(specs)} runs per trace "
            f"in {wall:.1f} s on this machine. Reproduce: `{cmd}`.")
    if refused:  # a policy that cannot run on a trace is left out of that row's mean
        note += "\n\nNot run (the row's mean is over the other traces):\n\n" + "\n".join(
            f"- {line}" for line in refused)
    print(md)
    print(note)
    for f in save_chart(recall_vs_rgpu(frame, "Attention recall vs r_GPU (shipped traces)"),
                        ROOT / "docs" / "figures" / "policy_recall"):
        print(f"wrote {f}")
    page = ROOT / "docs" / "results" / "policy-table.md"
    text = page.read_text()
    start, end = "<!-- policy-table:start -->", "<!-- policy-table:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{page}: no policy-table markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(page, f"{head}{start}\n{md}\n\n{note}\n{end}{tail}")
    print(f"updated {page}")


if __name__ == "__main__":
    main()
