"""``kvsim mismatch``: WnW §2.1 prefill–decode attention mismatch of traces vs the paper."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def mismatch(traces: Annotated[list[Path], typer.Argument(help="Traces or folders of traces")]) -> None:
    """Mass in the first 10% / half of the audio at prefill vs decode, top-K Jaccard, per-head
    Jaccard, next to the WnW paper's Voxtral figures."""
    from kvsim.trace.reader import Trace, find_traces
    from studies.mismatch import PAPER_VOXTRAL
    from studies.mismatch import mismatch as measure

    table = Table(title="WnW §2.1 mismatch")
    cols = [("prefill_first10", "prefill first 10%"), ("prefill_first_half", "prefill first half"),
            ("decode_first10", "decode first 10%"), ("decode_first_half", "decode first half"),
            ("jaccard_top100", "J@100"), ("jaccard_top500", "J@500"),
            ("head_jaccard_min", "head J min"), ("head_jaccard_max", "head J max"),
            ("head_jaccard_below_01", "heads J<0.1")]
    table.add_column("trace")
    for _, h in cols:
        table.add_column(h, justify="right")
    table.add_row("WnW paper (Voxtral)", *[f"{PAPER_VOXTRAL[k if k != 'head_jaccard_below_01' else 'head_jaccard_below_0.1']:.3f}" for k, _ in cols])
    for path in find_traces(traces):
        s = measure(Trace(path)).as_dict()
        table.add_row(path.name, *[f"{s[k]:.3f}" for k, _ in cols])
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command()(mismatch)
