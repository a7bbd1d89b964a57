"""Crash-safe file and directory writes: write beside the target, fsync, rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``path``; on success, fsync it and move it to
    ``path`` (replacing an existing one when ``overwrite``; otherwise :class:`FileExistsError`
    when ``path`` exists on entry or has appeared by the time the write completes, and
    ``path`` is left as it is). On error or a kill, only a ``*.tmp-*`` directory is left
    behind, which no reader accepts as a trace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and (path.exists() or path.is_symlink()):
        raise FileExistsError(path)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if not overwrite and (path.exists() or path.is_symlink()):
            raise FileExistsError(path)
        if path.exists():
            old = path.with_name(f"{path.name}{OLD_MARK}{uuid.uuid4().hex[:8]}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def clean_stale(parent: Path, name: str) -> None:
    """Remove leftovers (``name.tmp-*``, ``name.old-*``) of interrupted writes of ``name``."""
    for p in Path(parent).glob(f"{name}{TMP_MARK}*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for p in Path(parent).glob(f"{name}{OLD_MARK}*"):
        shutil.rmtree(p, ignore_errors=True)
