"""Deep validation of a trace: everything :class:`Trace` checks on open (schema, manifest,
member files, safetensors header, shapes, query positions, positions table, head scores),
plus the SHA-256 of every file and a NaN/inf scan of every tensor."""

from __future__ import annotations

from pathlib import Path

from kvsim.trace.reader import Trace


def validate_trace(path: str | Path) -> Trace:
    """Return the opened, verified trace, or raise :class:`~kvsim.trace.schema.TraceError`
    naming the file and the field."""
    return Trace(path, verify=True)
