"""Read and check the header of a safetensors file before any tensor is mapped.

Layout: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping tensor names
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data section
at ``8 + n``), an optional ``"__metadata__"`` object of strings, then the data. Every entry is
type- and range-checked here, so that mapping a tensor can never read outside the file or
with a dtype numpy does not know.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.trace.members import open_member
from kvsim.trace.schema import TENSOR_NAMES, TraceError

#: safetensors dtype -> numpy dtype, for the dtypes a trace may hold.
ST_DTYPES: dict[str, type[np.generic]] = {"F16": np.float16, "F32": np.float32, "I64": np.int64}

#: Largest header accepted (a trace header is a few hundred bytes).
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One checked header entry: ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(ST_DTYPES[self.dtype])

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path, size_limit: int) -> dict[str, TensorSpec]:
    """The checked tensor table of the safetensors file ``path`` (at most ``size_limit``
    bytes); :class:`TraceError` names the file and the bad entry."""
    name = str(path)
    with open_member(path, size_limit) as (fh, size):
        head = fh.read(8)
        if len(head) < 8:
            raise TraceError(name, "<header>", f"file of {size} bytes is too short to be safetensors")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise TraceError(name, "<header>", f"header length {n} impossible for a file of {size} bytes")
        raw = fh.read(n)
    try:
        table = json.loads(raw)
    except (ValueError, RecursionError):
        raise TraceError(name, "<header>", "header is not valid JSON") from None
    if not isinstance(table, dict):
        raise TraceError(name, "<header>", f"expected a JSON object, got {type(table).__name__}")
    _check_metadata(table.pop("__metadata__", {}), name)
    data_start = 8 + n
    specs = {key: _entry(key, value, name, data_start, size) for key, value in table.items()}
    _check_layout(specs, name, data_start, size)
    return specs


def _check_layout(specs: dict[str, TensorSpec], file: str, data_start: int, size: int) -> None:
    """Tensors tile the data section exactly, in offset order (no gap, no overlap): no two
    tensors can alias the same bytes, and no byte of the file is left unaccounted for."""
    at = data_start
    for spec in sorted(specs.values(), key=lambda s: (s.begin, s.end)):
        if spec.begin != at:
            raise TraceError(file, f"{spec.name}.data_offsets", "tensors overlap or leave a gap in the data section")
        at = spec.end
    if at != size:
        raise TraceError(file, "<header>", f"data section ends at byte {at}, the file at {size}")


def _check_metadata(meta: Any, file: str) -> None:
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TraceError(file, "__metadata__", "expected an object of strings")


def _entry(key: str, raw: Any, file: str, data_start: int, size: int) -> TensorSpec:
    """Check one header entry against the format and the file size."""
    if key not in TENSOR_NAMES:
        raise TraceError(file, key[:60], f"not a tensor of the trace format (expected {', '.join(TENSOR_NAMES)})")
    if not isinstance(raw, dict):
        raise TraceError(file, key, f"expected an object, got {type(raw).__name__}")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise TraceError(file, f"{key}.dtype", f"{dtype!r:.40} is not one of {', '.join(ST_DTYPES)}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise TraceError(file, f"{key}.shape", "expected a list of non-negative integers")
    offsets = raw.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise TraceError(file, f"{key}.data_offsets", "expected a list of two integers")
    begin, end = offsets
    if not 0 <= begin <= end or data_start + end > size:
        raise TraceError(file, f"{key}.data_offsets", f"[{begin}, {end}] outside the data section "
                         f"({size - data_start} bytes; truncated or corrupt)")
    if end - begin != math.prod(shape) * np.dtype(ST_DTYPES[dtype]).itemsize:
        raise TraceError(file, f"{key}.data_offsets", f"{end - begin} bytes do not hold shape {tuple(shape)} of {dtype}")
    return TensorSpec(key, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
