"""Write a safetensors file a slice at a time, so that no tensor is ever held whole.

The layout is the one ``safetensors.numpy.save_file`` writes (so a trace written either way is
byte-identical): an 8-byte little-endian header length, the header as compact JSON
(``"__metadata__"`` first, then the tensors in data order), padded with spaces to a multiple
of 8 bytes, then the data. Data order is the library's: larger dtypes first
(``I64`` before ``F32`` before ``F16``), ties by name.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType

import numpy as np

#: safetensors dtype code of each numpy dtype a trace stores, in the library's data order
#: (it writes dtypes of higher rank first)
ST_CODES: dict[np.dtype, str] = {np.dtype(np.int64): "I64", np.dtype(np.float32): "F32",
                                 np.dtype(np.float16): "F16"}
_RANK = {"I64": 2, "F32": 1, "F16": 0}


class SafetensorsStream:
    """A safetensors file whose tensors are written along their first axis, slab by slab.

    Parameters
    ----------
    path : Path
        The file to create.
    tensors : dict of name -> (dtype, shape)
        Every tensor the file will hold.
    metadata : dict of str -> str
        The header's ``__metadata__``.

    Every slab ``tensor[index]`` must be written (:meth:`write`) before :meth:`close`, which
    fails otherwise; bytes are written with ``pwrite`` at their final offsets.
    """

    def __init__(self, path: Path, tensors: dict[str, tuple[np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]) -> None:
        order = sorted(tensors, key=lambda n: (-_RANK[ST_CODES[np.dtype(tensors[n][0])]], n))
        header: dict[str, object] = {"__metadata__": metadata}
        self._slabs: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        at = 0
        for name in order:
            dtype, shape = np.dtype(tensors[name][0]), tuple(int(s) for s in tensors[name][1])
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape),
                            "data_offsets": [at, at + nbytes]}
            self._slabs[name] = (dtype, shape, at)
            at += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._data_start = 8 + len(text)
        self._written: dict[str, set[int]] = {name: set() for name in tensors}
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, len(text).to_bytes(8, "little") + text, 0)
        os.ftruncate(self._fd, self._data_start + at)

    def write(self, name: str, array: np.ndarray, index: int | None = None) -> None:
        """Write ``array`` (converted to the tensor's dtype) as ``tensor[index]``, or as the
        whole tensor when ``index`` is None."""
        dtype, shape, begin = self._slabs[name]
        slab = np.ascontiguousarray(array, dtype=dtype)
        want = shape if index is None else shape[1:]
        if slab.shape != want or (index is not None and not 0 <= index < shape[0]):
            raise ValueError(f"{name}[{index}]: shape {slab.shape}, expected {want} "
                             f"with index < {shape[0]}")
        offset = self._data_start + begin + (0 if index is None else index * slab.nbytes)
        view = memoryview(slab.reshape(-1).view(np.uint8))
        while view:
            done = os.pwrite(self._fd, view, offset)
            view, offset = view[done:], offset + done
        self._written[name].update(range(shape[0]) if index is None else (index,))

    def close(self) -> None:
        """Check that every slab was written, fsync and close the file (once; later calls do
        nothing)."""
        if self._fd < 0:
            return
        try:
            missing = [n for n, (_, shape, _) in self._slabs.items()
                       if len(self._written[n]) != shape[0]]
            if missing:
                raise ValueError(f"slabs of {', '.join(missing)} were never written")
            os.fsync(self._fd)
        finally:
            self._abandon()

    def _abandon(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abandon()
