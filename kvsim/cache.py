"""kvsim's cache folder: what it builds once and keeps between runs (minivox's assembled
model, the held-out text's source, Whisper base's assembled model)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def kvsim_cache(*parts: str) -> Path:
    """``$KVSIM_CACHE`` (when set and not empty), else ``~/.cache/kvsim``, joined with ``parts``."""
    return Path(os.environ.get("KVSIM_CACHE") or Path.home() / ".cache" / "kvsim", *parts)


def publish_dir(tmp: Path, out: Path) -> None:
    """Move the finished build ``tmp`` to ``out`` atomically; when another process published
    ``out`` first (two processes building the same cache at once), drop ``tmp``: either way
    no ``.tmp*`` directory is left behind."""
    if not out.exists():
        try:
            os.replace(tmp, out)
            return
        except OSError:
            if not out.exists():
                raise
    shutil.rmtree(tmp)
