"""Checks of the tensors of a trace against ``meta.json``: header shapes and dtypes, the
stored query positions, and the NaN/inf test of a float array."""

from __future__ import annotations

import numpy as np

from kvsim.trace.safetensors_header import TensorSpec
from kvsim.trace.schema import TraceError, TraceMeta

_ST_NAME = {"float16": "F16", "float32": "F32"}


def check_tensor_table(specs: dict[str, TensorSpec], meta: TraceMeta, file: str) -> None:
    """Shapes and dtypes of ``keys``, ``queries``, ``values`` and ``query_positions`` as
    ``meta.json`` implies them (``N_q`` is the length of ``query_positions``)."""
    m = meta.model
    qp = _spec(specs, "query_positions", file)
    if qp.dtype != "I64" or len(qp.shape) != 1:
        raise TraceError(file, "query_positions", f"expected a 1-d I64 tensor, got {qp.dtype} {qp.shape}")
    n_q = qp.shape[0]
    if not 1 <= n_q <= meta.n_positions:
        raise TraceError(file, "query_positions", f"{n_q} entries, expected 1..n_positions ({meta.n_positions})")
    kv_shape = (m.n_layers, m.n_kv_heads, meta.n_positions, m.head_dim)
    want = {"keys": kv_shape, "queries": (m.n_layers, m.n_q_heads, n_q, m.head_dim)}
    if meta.has_values:
        want["values"] = kv_shape
    elif "values" in specs:
        raise TraceError(file, "values", "stored, but meta.json has_values is false")
    for name, shape in want.items():
        spec = _spec(specs, name, file)
        if spec.dtype != _ST_NAME[m.dtype]:
            raise TraceError(file, name, f"dtype {spec.dtype} != {_ST_NAME[m.dtype]} (meta.json model.dtype {m.dtype})")
        if spec.shape != shape:
            raise TraceError(file, name, f"shape {spec.shape} != {shape} implied by meta.json")


def _spec(specs: dict[str, TensorSpec], name: str, file: str) -> TensorSpec:
    if name not in specs:
        raise TraceError(file, name, "tensor missing")
    return specs[name]


def check_query_positions(qp: np.ndarray, meta: TraceMeta, file: str) -> None:
    """Stored query positions are in ``[0, n_positions)``, strictly increasing, and include
    every answer query: the prompt's last position (it produced the first answer token) and
    every decode position."""
    bad = np.flatnonzero((qp < 0) | (qp >= meta.n_positions))
    if len(bad):
        raise TraceError(file, "query_positions", f"position {qp[bad[0]]} at index {bad[0]} outside "
                         f"[0, n_positions={meta.n_positions})")
    steps = np.flatnonzero(np.diff(qp) <= 0)
    if len(steps):
        i = steps[0]
        raise TraceError(file, "query_positions", f"not strictly increasing at index {i + 1} "
                         f"({qp[i]} then {qp[i + 1]})")
    answer = np.arange(meta.n_prefill - 1, meta.n_positions)
    missing = answer[~np.isin(answer, qp)]
    if len(missing):
        raise TraceError(file, "query_positions", f"no query stored for answer position {missing[0]} "
                         f"(positions {meta.n_prefill - 1}..{meta.n_positions - 1} need one)")


_HALF_EXPONENT = np.uint16(0x7C00)  # float16: NaN and ±inf are the values with every exponent bit set


def first_nonfinite(arr: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first NaN/inf of ``arr``, or None.

    float16 (the usual storage dtype) is tested on its bits, an integer pass about three
    times faster than ``np.isfinite`` on half floats.
    """
    if arr.dtype == np.float16:
        bad = (arr.view(np.uint16) & _HALF_EXPONENT) == _HALF_EXPONENT
    else:
        bad = ~np.isfinite(arr)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), arr.shape))
