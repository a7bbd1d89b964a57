"""Deep validation of a trace: everything :class:`Trace` checks on open, plus checksums,
a NaN/inf scan of every tensor, and the consistency of the positions table."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsim.trace.reader import Trace
from kvsim.trace.schema import META_FILE, POSITIONS_FILE, TENSORS_FILE, TraceError
from kvsim.trace.writer import sha256_file


def validate_trace(path: str | Path) -> Trace:
    """Return the opened trace, or raise :class:`TraceError` naming the file and field."""
    trace = Trace(path)
    meta = trace.meta
    for name, entry in meta.files.items():
        f = trace.path / name
        if entry.get("sha256") and sha256_file(f) != entry["sha256"]:
            raise TraceError(str(f), "<file>", "SHA-256 does not match meta.json (corrupted)")
    tensors = str(trace.path / TENSORS_FILE)
    names = ["keys", "queries"] + (["values"] if meta.has_values else [])
    for name in names:
        for layer in range(meta.model.n_layers):
            arr = trace._map(name)[layer]
            if not np.isfinite(arr).all():
                bad = np.argwhere(~np.isfinite(arr))[0].tolist()
                raise TraceError(tensors, name, f"non-finite value at layer {layer}, index {bad}")
    qp = trace.query_positions
    if len(qp) and (np.any(np.diff(qp) <= 0) or qp[0] < 0 or qp[-1] >= meta.n_positions):
        raise TraceError(tensors, "query_positions", "not strictly ascending within [0, n_positions)")
    decode = np.arange(meta.n_prefill, meta.n_positions)
    if not np.isin(decode, qp).all():
        raise TraceError(tensors, "query_positions", "a decode position has no stored query")

    pos = trace.positions
    pfile = str(trace.path / POSITIONS_FILE)
    if not np.array_equal(pos["position"].to_numpy(), np.arange(meta.n_positions)):
        raise TraceError(pfile, "position", "not 0..n_positions-1 in order")
    kinds = pos["kind"].to_numpy()
    if (kinds[meta.n_prefill:] != "generated").any() or (kinds[: meta.n_prefill] == "generated").any():
        raise TraceError(pfile, "kind", "'generated' must be exactly the decode positions")
    qidx = pos["query_index"].to_numpy()
    expect = np.full(meta.n_positions, -1)
    expect[qp] = np.arange(len(qp))
    if not np.array_equal(qidx, expect):
        raise TraceError(pfile, "query_index", "disagrees with tensors query_positions")
    audio = kinds == "audio"
    if audio.any():
        start = pos["audio_start_s"].to_numpy()[audio]
        end = pos["audio_end_s"].to_numpy()[audio]
        if not (np.isfinite(start).all() and np.isfinite(end).all()):
            raise TraceError(pfile, "audio_start_s", "audio positions need start and end times")
        if (end < start).any() or (np.diff(start) < 0).any():
            raise TraceError(pfile, "audio_start_s", "audio times must be ordered and end >= start")
    if meta.has_head_scores:
        hs = trace.head_scores
        want = (meta.model.n_layers, meta.model.n_kv_heads)
        if hs is not None and hs.voice_score.shape != want:
            raise TraceError(str(trace.path / META_FILE), "heads", f"shape != {want}")
    return trace
