"""The traces a study reads: arguments (traces or folders) or a default, every one opened
before any work, a bad one failing the study in one line."""

from __future__ import annotations

from pathlib import Path


def open_traces(args: list[Path] | None, default: list[Path]) -> list:
    """Open the traces ``args`` name (``default`` when none); exit 2 with one line
    (``<file>: <field>: <message>``) on a missing, empty or broken one, since a study with a
    trace silently left out would be a different study."""
    from kvsim.commands._errors import fail, print_error
    from kvsim.commands.traces import trace_arguments
    from kvsim.trace.reader import DuplicateTraceError, Trace, collect_traces
    from kvsim.trace.schema import TraceError

    try:
        paths, errors = collect_traces(trace_arguments(args) if args else default)
    except DuplicateTraceError as exc:  # one trace twice would weigh twice in every figure
        fail(exc)
    if not paths and not errors:
        fail("no *.kvtrace found")
    traces = []
    for path in paths:
        try:
            traces.append(Trace(path))
        except (TraceError, ValueError, OSError) as exc:
            errors.append(exc)
    for exc in errors[1:]:
        print_error(str(exc))
    if errors:
        fail(errors[0])
    return traces
