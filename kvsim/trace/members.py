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

_KINDS = [(stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a FIFO"),
          (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
          (stat.S_ISSOCK, "is a socket")]


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, e.g. ``"is a directory"``."""
    return next((name for test, name in _KINDS if test(mode)), "is not a regular file")


def _check_regular(path: Path, mode: int) -> None:
    """:class:`TraceError` ``<path>: <file>: is a directory, not a regular file`` (etc.)
    unless ``mode`` is a regular file's."""
    if not stat.S_ISREG(mode):
        raise TraceError(str(path), "<file>", f"{_kind(mode)}, not a regular file")


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
    _check_regular(path, st.st_mode)
    return st.st_size


@contextlib.contextmanager
def open_member(path: Path, limit: int) -> Iterator[tuple[BinaryIO, int]]:
    """Open ``path`` for reading without blocking; yield the file and its size. Refuses
    anything but a regular file of at most ``limit`` bytes (checked on the descriptor, before
    Python wraps it: ``os.fdopen`` of a directory would raise IsADirectoryError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise TraceError(str(path), "<file>", "missing") from None
    except OSError as exc:
        raise TraceError(str(path), "<file>", f"cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        _check_regular(Path(path), st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as fh:
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


def read_text_member(path: Path, limit: int = MAX_JSON_BYTES) -> str:
    """:func:`read_member` decoded as UTF-8; :class:`TraceError` ``not UTF-8 text`` too."""
    try:
        return read_member(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(str(path), "<file>", "not UTF-8 text") from None


def member_sha256(path: Path, size: int) -> str:
    """Hex SHA-256 of the regular file ``path``, which must hold exactly ``size`` bytes."""
    h = hashlib.sha256()
    with open_member(path, size) as (fh, _):
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
