"""``kvsim info``, ``kvsim validate`` and ``kvsim synth``: trace tools."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvsim.commands._errors import fail, print_error


def trace_arguments(args: list[Path]) -> list[Path]:
    """The arguments as a shell glob gives them (``traces/*``): a regular file that is not a
    ``*.kvtrace`` (a README, a notes file) is reported once on stderr and skipped; everything
    else is kept for the trace checks. Fails (exit 2) when nothing is left."""
    from kvsim.trace.schema import TRACE_SUFFIX

    kept = []
    for arg in args:
        if arg.is_file() and arg.suffix != TRACE_SUFFIX:
            print_error(f"{arg}: not a *{TRACE_SUFFIX} trace", label="skipped:")
        else:
            kept.append(arg)
    if args and not kept:
        fail(f"no *{TRACE_SUFFIX} trace among the {len(args)} arguments")
    return kept


def each_trace(args: list[Path], work: Callable[[Path], None], label: str = "error:") -> int:
    """Call ``work`` on every trace that ``args`` name (traces or folders of traces; other
    files skipped by :func:`trace_arguments`). A bad argument or trace is reported as one line
    on stderr (``<file>: <field>: <message>``) and the others go on; returns how many failed.
    A trace named twice, or arguments that hold no trace at all, fail the command before any
    work (exit 2, as ``kvsim replay``)."""
    from kvsim.trace.reader import DuplicateTraceError, collect_traces
    from kvsim.trace.schema import TraceError

    try:
        paths, errors = collect_traces(trace_arguments(args))
    except DuplicateTraceError as exc:
        fail(exc)
    for exc in errors:
        print_error(str(exc), label)
    if errors and not paths:
        raise typer.Exit(2)
    failed = len(errors)
    for path in paths:
        try:
            work(path)
            continue
        except TraceError as exc:
            message = str(exc)
        except Exception as exc:  # noqa: BLE001 -- one line per trace, never a traceback
            message = f"{path}: <unexpected>: {type(exc).__name__}: {exc} (a kvsim bug: please report it)"
        print_error(message, label)
        failed += 1
    return failed


def info(traces: Annotated[list[Path], typer.Argument(help="*.kvtrace directories or folders of traces")]) -> None:
    """Print a summary of each trace (the checks made on open; `kvsim validate` also checks checksums and scans for NaN/inf).

    Exits non-zero if any trace is broken; files that are not traces (a README in traces/*) are reported and skipped.
    """
    out = Console(emoji=False)
    if each_trace(traces, lambda path: out.print(_info_table(path))):
        raise typer.Exit(1)


def _info_table(path: Path) -> Table:
    import numpy as np

    from kvsim.trace.reader import Trace

    t = Trace(path)
    m = t.meta
    kinds = dict(t.positions.group_by("kind").len().iter_rows())
    scores = t.head_scores
    rows = [
        ("model", f"{m.model.name}: {m.model.n_layers} layers x {m.model.n_q_heads} q / "
                  f"{m.model.n_kv_heads} kv heads x {m.model.head_dim}, {m.model.audio_tokens_per_s:g} audio tok/s"),
        ("positions", f"{m.n_positions} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))})"),
        ("audio", f"{t.n_audio} tokens = {t.audio_seconds:.1f} s"),
        ("audio padding", f"{len(t.padding_positions)} tokens" if t.padding_recorded else "not recorded"),
        ("prefill / decode", f"{m.n_prefill} / {m.n_decode} steps"),
        ("observation window", f"{len(t.window_positions)} prompt queries "
                               f"({int(np.isin(t.window_positions, t.audio_positions).sum())} audio)"),
        ("values stored", str(m.has_values)),
        ("head scores", f"yes ({scores.source})" if scores is not None else "no"),
        ("input transform", str(m.input_transform)),
        ("size on disk", f"{t.disk_bytes() / 1e6:.1f} MB ({t.disk_bytes() / t.tensor_bytes():.4f} x raw tensor bytes)"),
        ("MB per audio minute", f"{t.disk_bytes() / 1e6 / max(t.audio_seconds / 60, 1e-9):.1f}"),
        ("generated", (m.generated_text[:100] + "...") if len(m.generated_text) > 100 else m.generated_text),
        ("reference", str(m.reference_text)[:100]),
        ("provenance", ", ".join(f"{k}={v}" for k, v in m.provenance.items() if isinstance(v, str | int | float))[:200]),
    ]
    table = Table(title=escape(f"{t.name} ({t.path})"), show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # long paths and hashes wrap, never cut
    for k, v in rows:  # every value may hold user text: escaped, never read as markup
        table.add_row(k, escape(v))
    return table


def validate(traces: Annotated[list[Path], typer.Argument(help="Trace directories or folders of traces")]) -> None:
    """Check traces completely (schema, manifest, checksums, shapes, NaN scan, positions).

    Prints one line per trace (broken ones on stderr); exits non-zero if any is broken. Files that are not traces (a README in traces/*) are reported and skipped.
    """
    from kvsim.trace.validate import validate_trace

    out = Console(soft_wrap=True, emoji=False, highlight=False)

    def check(path: Path) -> None:
        t = validate_trace(path)
        out.print(f"ok     {path} ({t.n_audio} audio, {t.meta.n_decode} steps)", markup=False)

    if each_trace(traces, check, label="BROKEN"):
        raise typer.Exit(1)


def synth(
    out: Annotated[Path, typer.Argument(help="Output trace path (NAME.kvtrace; the suffix is added when missing). An existing one is refused unless --overwrite")],
    preset: Annotated[str, typer.Option(help="Backbone shape: voxtral-mini, qwen-omni, minivox, small, tiny")] = "minivox",
    audio_seconds: Annotated[float, typer.Option(help="Audio length in seconds, in (0, 14400]")] = 60.0,
    decode_steps: Annotated[int, typer.Option(help="Number of decode steps, in [1, 65536]")] = 120,
    seed: Annotated[int, typer.Option(help="Random seed (>= 0)")] = 0,
    values: Annotated[bool, typer.Option(help="Store values (for output-error metrics)")] = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a trace directory already at OUT (without it, an existing OUT is refused)")] = False,
) -> None:
    """Synthesise a trace with real q/k whose attention has WnW §2.1's structure.

    It is written one layer at a time, so memory holds one layer, not the whole trace, and atomically: OUT appears complete or not at all. The options and OUT are checked before any work."""
    from kvsim.commands._options import OptionError, check_range
    from kvsim.synth import MAX_AUDIO_SECONDS, MAX_DECODE_STEPS, SynthConfig, write_synthetic

    try:
        check_range("--audio-seconds", audio_seconds, 0, MAX_AUDIO_SECONDS, low_open=True)
        check_range("--decode-steps", decode_steps, 1, MAX_DECODE_STEPS)
        check_range("--seed", seed, 0)
    except OptionError as exc:
        fail(exc)
    target = _synth_target(out, overwrite)
    try:
        cfg = SynthConfig(preset=preset, audio_seconds=audio_seconds,
                          decode_steps=decode_steps, seed=seed, store_values=values)
        path = write_synthetic(target, cfg, overwrite=overwrite)
    except (KeyError, ValueError) as exc:
        fail(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    except FileExistsError:  # appeared while the trace was drawn: kept as it is
        fail(f"{target}: appeared while the trace was written; kept, nothing written")
    except OSError as exc:  # disk full, permissions: the partial write is already removed
        fail(f"{target}: {exc.strerror or exc}; nothing written", code=1)
    Console().print(f"wrote {path}", markup=False)


def _synth_target(out: Path, overwrite: bool) -> Path:
    """The ``*.kvtrace`` path ``kvsim synth OUT`` writes, checked before any work: one line
    and exit 2 when something is already there (a directory is replaced only with
    ``--overwrite``, anything else never), or when the nearest existing folder above it is
    not a writable directory."""
    from kvsim.rundir import OutDirError, check_creatable
    from kvsim.trace.writer import trace_path

    target = trace_path(out)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        fail(f"{target}: exists and is not a directory; not replaced")
    if target.exists() and not overwrite:
        fail(f"{target}: already exists; not replaced (--overwrite replaces it)")
    try:
        check_creatable(target.parent, str(target))
    except OutDirError as exc:
        fail(exc)
    return target


COMMANDS = (info, validate, synth)
