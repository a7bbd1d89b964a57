"""``kvsim alignment``: the audio position the decoder reads per answer token, and its jumps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def alignment(
    traces: Annotated[list[Path], typer.Argument(help="Traces or folders of traces")],
    words: Annotated[list[Path] | None, typer.Option("--words", help="Reference word times per trace, in order (.words.json/.tsv): adds the share of written words that match the audio at the peak")] = None,
    layers: Annotated[str | None, typer.Option(help="Comma-separated layers to read the path from (default: the most monotonic)")] = None,
    n_layers: Annotated[int, typer.Option(help="How many of the most monotonic layers to use")] = 4,
    min_jump: Annotated[float, typer.Option(help="A jump is a move of the filtered path by more than this many seconds")] = 5.0,
    smooth: Annotated[int, typer.Option(help="Median filter width in answer tokens")] = 5,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write each trace's path as OUT/<trace>.alignment.parquet")] = None,
) -> None:
    """Alignment path of each trace: the audio time of the attention peak per answer token in
    the decoder's most monotonic layers; its jumps back (re-read audio: repeated text) and
    forward (skipped audio), the audio it visits, and with --words whether the model writes
    the word spoken where it looks."""
    from kvsim.trace.atomic import atomic_file
    from kvsim.trace.reader import Trace, TraceError, find_traces
    from studies.alignment import alignment as measure
    from studies.alignment import chance_agreement, word_agreement
    from tracer.alignment import AlignmentError, load_word_times

    console = Console(width=max(Console().width, 150))
    paths = find_traces(traces)
    if words and len(words) != len(paths):
        console.print(f"[red]error:[/] --words: {len(words)} files for {len(paths)} traces")
        raise typer.Exit(2)
    table = Table(title=f"Alignment paths (jumps > {min_jump:g} s)")
    for col in ("trace", "layers (monotonicity)", "tokens", "jumps back", "jumps forward",
                "audio visited", "writes what it reads"):
        table.add_column(col, justify="left" if col == "trace" else "right")
    for i, path in enumerate(paths):
        try:
            trace = Trace(path)
            res = measure(trace, layers=[int(x) for x in layers.split(",")] if layers else None,
                          n_layers=n_layers, smooth=smooth, min_jump_s=min_jump)
            ref = load_word_times(words[i]) if words else None
        except (TraceError, AlignmentError, ValueError) as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        speech = max(w.end for w in ref) if ref else res.audio_seconds
        agree = (f"{word_agreement(res.path, ref):.0%} (chance {chance_agreement(res.path, ref):.0%})"
                 if ref else "n/a (no --words)")
        back = res.back_jumps
        table.add_row(
            trace.name,
            ", ".join(f"{x} ({m:.2f})" for x, m in zip(res.layers, res.layer_monotonicity, strict=True)),
            str(res.path.height),
            f"{len(back)} ({-sum(j.seconds for j in back):.0f} s)",
            f"{len(res.forward_jumps)} ({sum(j.seconds for j in res.forward_jumps):.0f} s)",
            f"{min(res.covered_seconds(), speech):.0f} of {speech:.0f} s",
            agree)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_file(out / f"{trace.name}.alignment.parquet") as tmp:
                res.path.write_parquet(tmp)
        for j in res.jumps:
            console.print(f"{trace.name}: token {j.step}: {j.from_s:.1f} s -> {j.to_s:.1f} s "
                          f"({j.seconds:+.1f} s)")
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(alignment)
