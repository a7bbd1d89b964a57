"""Safe access to the files of a trace directory.

The manifest in ``meta.json`` names files, never paths: a member is read only when it is a
regular file inside the trace directory (a symlink must resolve inside it; directories,
devices and FIFOs are refused). Files are opened non-blocking and checked again with
``fstat`` on the open descriptor, and every read is bounded by a size, so that a hostile
trace (``/dev/zero``, a FIFO, a link to a huge file) fails at once with a one-line
:class:`TraceError` instead of hanging or exhausting memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kvsim.trace.schema import TraceError

#: Largest ``meta.json`` or ``heads.json`` read (both are a few kB in practice).
MAX_JSON_BYTES = 64 << 20

_KINDS = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def member_size(trace_dir: Path, name: str) -> int:
    """Size in bytes of the member ``name`` of ``trace_dir`` after checking that it is a
    regular file inside the directory; nothing is opened."""
    path = trace_dir / name
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            root = os.path.realpath(trace_dir)
            if os.path.commonpath([os.path.realpath(path), root]) != root:
                raise TraceError(str(path), "<file>", "symlink pointing outside the trace directory")
            st = os.stat(path)
    except FileNotFoundError:
        raise TraceError(str(path), "<file>", "missing") from None
    except OSError as exc:
        raise TraceError(str(path), "<file>", f"cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(str(path), "<file>", f"{_kind(st.st_mode)}, not a regular file")
    return st.st_size


@contextlib.contextmanager
def open_member(path: Path, limit: int) -> Iterator[tuple[BinaryIO, int]]:
    """Open ``path`` for reading without blocking; yield the file and its size. Refuses
    anything but a regular file of at most ``limit`` bytes (checked on the descriptor)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise TraceError(str(path), "<file>", "missing") from None
    except OSError as exc:
        raise TraceError(str(path), "<file>", f"cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceError(str(path), "<file>", f"{_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise TraceError(str(path), "<file>", f"{st.st_size} bytes, more than the {limit} expected")
        try:
            yield fh, st.st_size
        except OSError as exc:
            raise TraceError(str(path), "<file>", f"read error ({exc.strerror})") from None


def read_member(path: Path, limit: int) -> bytes:
    """The whole content of the regular file ``path`` (at most ``limit`` bytes)."""
    with open_member(path, limit) as (fh, _):
        return fh.read(limit)


def member_sha256(path: Path, size: int) -> str:
    """Hex SHA-256 of the regular file ``path``, which must hold exactly ``size`` bytes."""
    h = hashlib.sha256()
    with open_member(path, size) as (fh, _):
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
