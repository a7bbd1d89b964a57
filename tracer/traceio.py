"""Load a whole trace back into memory as :class:`kvsim.trace.TraceData` (to rewrite it, e.g.
with head scores attached)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvsim.trace import Trace, TraceData


def load_trace_data(path: str | Path) -> TraceData:
    t = Trace(path)
    layers = range(t.meta.model.n_layers)
    keys = np.stack([np.array(t.keys(i)) for i in layers])
    queries = np.stack([np.array(t.queries(i)) for i in layers])
    values = np.stack([np.array(t.values(i)) for i in layers]) if t.meta.has_values else None
    meta = t.meta
    meta.files = {}
    return TraceData(meta=meta, keys=keys, queries=queries,
                     query_positions=t.query_positions.copy(), positions=t.positions,
                     values=values, head_scores=t.head_scores)
