"""``kvsim alignment``: the audio position the decoder reads per answer token, and its jumps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import polars as pl
import typer

from kvsim.commands._errors import err
from kvsim.commands._table import FormatOption, TableFormat, WideOption


def alignment(
    traces: Annotated[list[Path], typer.Argument(help="Traces or folders of traces")],
    words: Annotated[list[Path] | None, typer.Option("--words", help="Reference word times per trace, in order (.words.json/.tsv): adds the share of written words that match the audio at the peak")] = None,
    layers: Annotated[str | None, typer.Option(help="Comma-separated layers to read the path from (default: the most monotonic)")] = None,
    n_layers: Annotated[int, typer.Option(help="How many of the most monotonic layers to use")] = 4,
    min_jump: Annotated[float, typer.Option(help="A jump is a move of the filtered path by more than this many seconds")] = 5.0,
    smooth: Annotated[int, typer.Option(help="Median filter width in answer tokens")] = 5,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write each trace's path as OUT/<trace>.alignment.parquet")] = None,
    wide: WideOption = False,
    fmt: FormatOption = TableFormat.table,
) -> None:
    """Alignment path of each trace: the audio time of the attention peak per answer token in the decoder's most monotonic layers; its jumps back (re-read audio: repeated text) and forward (skipped audio), the audio it visits, and with --words whether the model writes the word spoken where it looks (word match; n/a without --words).

    A broken trace is one line on stderr; the others are measured; the exit code is non-zero if any failed.
    """
    from kvsim.commands._errors import fail
    from kvsim.commands._table import Column, print_frame
    from kvsim.commands.traces import each_trace, trace_arguments
    from kvsim.trace.reader import DuplicateTraceError, collect_traces

    chosen = _parse_options(layers, n_layers, smooth, min_jump)
    if out is not None:
        from kvsim.rundir import OutDirError, check_out_dir

        try:
            check_out_dir(out)
        except OutDirError as exc:
            fail(exc)
    traces = trace_arguments(traces)
    try:
        paths, _ = collect_traces(traces)
    except DuplicateTraceError as exc:
        fail(exc)
    if words and len(words) != len(paths):
        fail(f"--words: {len(words)} files for {len(paths)} traces")
    words_of = dict(zip(paths, words, strict=True)) if words else {}
    rows: list[dict] = []

    def align_one(path: Path) -> None:
        row, jump_lines = _align_trace(path, words_of.get(path), chosen, n_layers, smooth, min_jump, out)
        rows.append(row)
        for line in jump_lines:
            err.print(line, markup=False, highlight=False)

    failed = each_trace(traces, align_one)
    if rows:
        print_frame(pl.DataFrame(rows), [Column(k, h, text=k == "trace", compact=c) for k, h, c in COLUMNS],
                    fmt=fmt, wide=wide, title=f"Alignment paths (jumps > {min_jump:g} s)")
    if failed:
        raise typer.Exit(1)


#: (key, header, in the compact set) of the alignment table (the title says they are jumps;
#: the compact set fits 80 columns with the shipped traces' names).
COLUMNS = [("trace", "trace", True), ("layers", "layers (monotonicity)", False),
           ("tokens", "tokens", True), ("back", "back", True), ("forward", "forward", True),
           ("visited", "visited", True), ("agreement", "word match", True)]


def _parse_options(layers: str | None, n_layers: int, smooth: int, min_jump: float) -> list[int] | None:
    """Range-check the options (one line and exit 2 on a bad one); the chosen layers."""
    from kvsim.commands._errors import fail
    from kvsim.commands._options import OptionError, check_positive_ints, check_range
    from kvsim.specs import option_items

    try:
        check_positive_ints(n_layers=n_layers, smooth=smooth)
        check_range("--min-jump", min_jump, 0, low_open=True)
    except OptionError as exc:
        fail(exc)
    if layers is None:
        return None
    try:
        return [int(x) for x in option_items(layers, "--layers", "layer")]
    except OptionError as exc:
        fail(exc)
    except ValueError:
        fail(f"option --layers: {layers!r} is not a comma-separated list of integers")


def agreement_text(path: pl.DataFrame, reference: list | None) -> str:
    """The word-match cell: the share of written words spoken at the path's peak, and chance.

    ``n/a`` without ``--words``, and ``n/a`` with the reason when the trace names no written
    words (traced with ``--aligner none``), never a bare ``nan%``.
    """
    from kvsim.studies.alignment import chance_agreement, word_agreement

    if not reference:
        return "n/a"  # needs --words
    if path["word"].is_null().all():
        return "n/a (no words in the trace: traced with --aligner none)"
    share = word_agreement(path, reference)
    if math.isnan(share):
        return "n/a (no written words)"
    return f"{share:.0%} (chance {chance_agreement(path, reference):.0%})"


def _align_trace(path: Path, words: Path | None, layers: list[int] | None, n_layers: int,
                 smooth: int, min_jump: float, out: Path | None) -> tuple[dict, list[str]]:
    """Measure one trace: its table row and its jump lines; writes the path under ``out``."""
    from kvsim.studies.alignment import alignment as measure
    from kvsim.trace.atomic import atomic_file
    from kvsim.trace.reader import Trace
    from kvsim.trace.schema import TraceError
    from kvsim.tracer.alignment import AlignmentError, load_word_times

    trace = Trace(path)
    n = trace.meta.model.n_layers
    if layers is not None and not all(0 <= x < n for x in layers):
        raise TraceError(str(path), "--layers", f"{layers} not all in 0..{n - 1} (the model has {n} layers)")
    res = measure(trace, layers=layers, n_layers=n_layers, smooth=smooth, min_jump_s=min_jump)
    try:
        ref = load_word_times(words) if words else None
    except AlignmentError as exc:
        # the loader's message starts with the file, which TraceError names already
        raise TraceError(str(words), "--words", str(exc).removeprefix(f"{words}: ")) from None
    speech = max(w.end for w in ref) if ref else res.audio_seconds
    agree = agreement_text(res.path, ref)
    back, forward = res.back_jumps, res.forward_jumps
    row = {"trace": trace.name,
           "layers": ", ".join(f"{x} ({m:.2f})" for x, m in zip(res.layers, res.layer_monotonicity, strict=True)),
           "tokens": res.path.height,
           "back": f"{len(back)} ({-sum(j.seconds for j in back):.0f} s)",
           "forward": f"{len(forward)} ({sum(j.seconds for j in forward):.0f} s)",
           "visited": f"{min(res.covered_seconds(), speech):.0f} of {speech:.0f} s",
           "agreement": agree}
    if out is not None:
        target = out / f"{trace.name}.alignment.parquet"
        try:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_file(target) as tmp:
                res.path.write_parquet(tmp)
        except OSError as exc:
            raise TraceError(str(target), "<write>", exc.strerror or str(exc)) from None
    jumps = [f"{trace.name}: token {j.step}: {j.from_s:.1f} s -> {j.to_s:.1f} s ({j.seconds:+.1f} s)"
             for j in res.jumps]
    return row, jumps


COMMANDS = (alignment,)
