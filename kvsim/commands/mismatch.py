"""``kvsim mismatch``: WnW §2.1 prefill–decode attention mismatch of traces vs the paper."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text


def mismatch(traces: Annotated[list[Path], typer.Argument(help="Traces or folders of traces")]) -> None:
    """Mass in the first 10% / half of the audio at prefill vs decode (and in the first 10% of the speech, from the first word's onset, when the trace has word timings), top-K Jaccard, per-head Jaccard, next to the WnW paper's Voxtral figures.

    A broken trace is one line on stderr; the others are measured; the exit code is non-zero if any failed. One column per trace: with many traces the table is wider than the terminal, never cut.
    """
    from kvsim.commands._table import new_table, print_whole
    from kvsim.commands.traces import each_trace
    from kvsim.studies.mismatch import PAPER_VOXTRAL
    from kvsim.studies.mismatch import mismatch as measure
    from kvsim.trace.reader import Trace

    cols = [("prefill_first10", "prefill mass, first 10% of audio"),
            ("prefill_first_half", "prefill mass, first half"),
            ("decode_first10", "decode mass, first 10% of audio"),
            ("decode_first_half", "decode mass, first half"),
            ("prefill_first10_speech", "prefill mass, first 10% of speech"),
            ("decode_first10_speech", "decode mass, first 10% of speech"),
            ("jaccard_top100", "top-100 Jaccard"), ("jaccard_top500", "top-500 Jaccard"),
            ("head_jaccard_min", "per-head Jaccard, min"),
            ("head_jaccard_max", "per-head Jaccard, max"),
            ("head_jaccard_below_01", "share of heads with Jaccard < 0.1")]
    stats: dict[str, dict] = {}

    def measure_one(path: Path) -> None:
        stats[str(path)] = measure(Trace(path)).as_dict()

    failed = each_trace(traces, measure_one)
    if stats:
        table = new_table("WnW §2.1 prefill-decode mismatch")
        table.add_column("statistic")
        table.add_column("WnW paper (Voxtral)", justify="right")
        for name in stats:
            table.add_column(Text(Path(name).stem), justify="right", no_wrap=True)
        for key, label in cols:
            table.add_row(label, _fmt(PAPER_VOXTRAL.get(key)), *[_fmt(s[key]) for s in stats.values()])
        print_whole(table)
        Console().print("'of speech' starts at the first word's onset (trace word timings); "
                        "n/a when the trace has none.")
        for note in _trivial_jaccard_notes(stats):
            Console().print(note, markup=False)
    if failed:
        raise typer.Exit(1)


def _fmt(x: float | None) -> str:
    if x is None:
        return "not reported"
    return "n/a" if x != x else f"{x:.3f}"


COMMANDS = (mismatch,)


def _trivial_jaccard_notes(stats: dict[str, dict]) -> list[str]:
    """A note per trace whose audio has at most K tokens: its top-K sets are the whole audio,
    so its top-K Jaccard is 1 by construction and says nothing (K = 100, 500)."""
    notes = []
    for name, s in stats.items():
        ks = [k for k in (100, 500) if s["n_audio"] <= k]
        if ks:
            notes.append(f"{Path(name).stem}: T_a = {s['n_audio']} audio tokens, so its top-"
                         f"{'/'.join(map(str, ks))} Jaccard is 1 by construction (both sets are "
                         "the whole audio).")
    return notes
