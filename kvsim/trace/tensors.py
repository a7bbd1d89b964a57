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


#: per float dtype: the unsigned integer of its width, the mask that clears the sign bit, and
#: the smallest magnitude bits of a non-finite value (every exponent bit set: ±inf and NaN)
_FLOAT_BITS = {
    np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}
#: elements tested per pass: a chunk and its work array stay in cache, and no temporary as
#: large as a layer is allocated (inside a replay, two such temporaries made the test 7x slower)
_CHUNK = 1 << 16


def first_nonfinite(arr: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first NaN/inf of ``arr``, or None.

    IEEE floats are tested on their bits, a chunk at a time: with the sign bit cleared, a value
    is non-finite exactly when its bits are at least those of +inf. Other dtypes use
    ``np.isfinite``.
    """
    spec = _FLOAT_BITS.get(arr.dtype)
    if spec is None:
        bad = ~np.isfinite(arr)
        return _unravel(int(np.argmax(bad)), arr.shape) if bad.any() else None
    uint, magnitude, infinity = spec
    bits = arr.reshape(-1).view(uint)  # in C order (a copy if arr is not C-contiguous)
    work = np.empty(min(_CHUNK, bits.size), dtype=uint)
    for start in range(0, bits.size, _CHUNK):
        part = bits[start : start + _CHUNK]
        chunk = np.bitwise_and(part, uint(magnitude), out=work[: part.size])
        if chunk.max() >= infinity:
            return _unravel(start + int(np.argmax(chunk >= infinity)), arr.shape)
    return None


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index in an array of ``shape`` of its C-order flat index ``flat``, as Python ints."""
    return tuple(int(i) for i in np.unravel_index(flat, shape))
