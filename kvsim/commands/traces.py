"""``kvsim info``, ``kvsim validate`` and ``kvsim synth``: trace tools."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

err = Console(stderr=True, soft_wrap=True)


def info(trace: Annotated[Path, typer.Argument(help="A *.kvtrace directory")]) -> None:
    """Print a summary of a trace."""
    import numpy as np

    from kvsim.trace.reader import Trace
    from kvsim.trace.schema import TraceError

    try:
        t = Trace(trace)
        pos = t.positions
    except TraceError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
    m = t.meta
    kinds = dict(pos.group_by("kind").len().iter_rows())
    table = Table(title=f"{t.name}", show_header=False)
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
        ("head scores", "yes (" + (t.head_scores.source if t.head_scores else "") + ")" if m.has_head_scores else "no"),
        ("input transform", str(m.input_transform)),
        ("size on disk", f"{t.disk_bytes() / 1e6:.1f} MB ({t.disk_bytes() / t.tensor_bytes():.4f} x raw tensor bytes)"),
        ("MB per audio minute", f"{t.disk_bytes() / 1e6 / max(t.audio_seconds / 60, 1e-9):.1f}"),
        ("generated", (m.generated_text[:100] + "...") if len(m.generated_text) > 100 else m.generated_text),
        ("reference", str(m.reference_text)[:100]),
        ("provenance", ", ".join(f"{k}={v}" for k, v in m.provenance.items() if isinstance(v, str | int | float))[:200]),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def validate(traces: Annotated[list[Path], typer.Argument(help="Trace directories or folders of traces")]) -> None:
    """Check traces completely (schema, manifest, checksums, shapes, NaN scan, positions).
    Prints one line per trace; exits non-zero if any is broken."""
    from kvsim.trace.reader import find_traces
    from kvsim.trace.schema import TraceError
    from kvsim.trace.validate import validate_trace

    bad = 0
    out = Console(soft_wrap=True)
    candidates: list[Path] = []
    for p in traces:
        if p.is_dir() and not (p / "meta.json").exists() and p.suffix != ".kvtrace":
            found = find_traces([p])
            if not found:
                err.print(f"[red]error:[/] {p}: <directory>: contains no *.kvtrace")
                bad += 1
            candidates += found
        else:
            candidates.append(p)
    for p in candidates:
        try:
            t = validate_trace(p)
            out.print(f"ok     {p} ({t.n_audio} audio, {t.meta.n_decode} steps)")
        except TraceError as exc:
            bad += 1
            out.print(f"[red]BROKEN[/] {exc}")
    if bad:
        raise typer.Exit(1)


def synth(
    out: Annotated[Path, typer.Argument(help="Output trace path (NAME.kvtrace)")],
    preset: Annotated[str, typer.Option(help="Backbone shape: voxtral-mini, qwen-omni, minivox, small, tiny")] = "minivox",
    audio_seconds: Annotated[float, typer.Option(help="Audio length in seconds")] = 60.0,
    decode_steps: Annotated[int, typer.Option(help="Number of decode steps")] = 120,
    seed: Annotated[int, typer.Option(help="Random seed")] = 0,
    values: Annotated[bool, typer.Option(help="Store values (for output-error metrics)")] = True,
) -> None:
    """Synthesise a trace with real q/k whose attention has WnW §2.1's structure."""
    from kvsim.synth import SynthConfig, synthesize
    from kvsim.trace.writer import write_trace

    try:
        data = synthesize(SynthConfig(preset=preset, audio_seconds=audio_seconds,
                                      decode_steps=decode_steps, seed=seed, store_values=values))
    except (KeyError, ValueError) as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    path = write_trace(out, data)
    Console().print(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command()(info)
    app.command()(validate)
    app.command()(synth)
