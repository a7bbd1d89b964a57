"""One output directory per batch run (``kvsim replay``, ``live``, ``trace``): checked before
any work, locked against a second writer, described by a run manifest, filled one input at a
time so that a crash loses at most the input in flight.

Layout under ``--out``::

    run.json          the run manifest: command line, start/end time, kvsim version, inputs,
                      which completed or failed, failed output steps (replay --simulate,
                      --plot), status running | complete | failed
    .kvsim.lock       advisory lock: the pid of the process writing here
    parts/<key>.parquet  the results of one finished input (written atomically)
    steps/...         per-run step logs, listed in run.json under the input that wrote them
    results.parquet   the combined table, written atomically when the run ends (last)

A fresh run removes what an earlier run left in the names it manages (``MANAGED``), so two
runs never mix; ``resume`` keeps the inputs an earlier run with the same configuration
completed and runs only the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from kvsim.trace.atomic import TMP_MARK, atomic_file, atomic_write_text

MANIFEST = "run.json"
LOCK = ".kvsim.lock"
PARTS = "parts"
#: Outputs combined over all inputs at the end of a run.
COMBINED = ("results.parquet", "runs.parquet", "sim_results.parquet", "recall_vs_rgpu.html",
            "recall_vs_rgpu.png", "wer_vs_rgpu.html", "wer_vs_rgpu.png")
#: Entries of an output directory that belong to one run and are replaced by a fresh run.
MANAGED = (MANIFEST, PARTS, "steps", *COMBINED)


class OutDirError(ValueError):
    """The output directory cannot be used; ``str()`` is the one-line reason."""


def input_error(path: object, exc: BaseException) -> str:
    """One line ``path: message`` for an error raised while processing one input (the path is
    not repeated when the message already starts with it)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    own = type(exc).__module__.split(".")[0] in ("kvsim", "tracer", "policies")
    if not own and type(exc) not in (ValueError, OSError, FileNotFoundError):
        text = f"{type(exc).__name__}: {text}"  # unexpected: name the kind of failure
    return text if text.startswith(str(path)) else f"{path}: {text}"


def check_creatable(path: Path, label: str) -> None:
    """Raise :class:`OutDirError` ``LABEL: reason`` unless the nearest entry at or above
    ``path`` that exists (a dangling link counts) is a writable directory, so that ``path``
    can be made there. Creates nothing."""
    probe = Path(path)
    while not probe.exists() and not probe.is_symlink():
        probe = probe.parent
    if not probe.is_dir():
        raise OutDirError(f"{label}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutDirError(f"{label}: {probe} is not writable")


def check_out_dir(path: Path) -> None:
    """Raise :class:`OutDirError` unless ``path`` is (or can be created as) a writable
    directory. Checked before any work starts; creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutDirError(f"--out {path}: exists and is not a directory")
    check_creatable(path, f"--out {path}")


def check_out_file(path: Path) -> None:
    """Raise :class:`OutDirError` ``--out PATH: reason`` unless ``path`` can be written as a
    file: not a folder, and its folder an existing or creatable writable directory. Checked
    before any work; creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise OutDirError(f"--out {path}: is a directory; give the file to write")
    check_creatable(path.parent, f"--out {path}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(path: Path) -> Path:
    """Create ``path/.kvsim.lock`` holding this pid; a lock left by a dead process is taken
    over. Raises :class:`OutDirError` while another live process holds it."""
    lock = Path(path) / LOCK
    host = socket.gethostname()
    tmp = lock.with_name(f"{LOCK}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": host}))
    try:
        for _ in range(2):
            try:
                os.link(tmp, lock)  # atomic: fails when the lock exists
                return lock
            except FileExistsError:
                holder = _lock_holder(lock)
                if holder is not None and (holder.get("host") != host or _pid_alive(holder["pid"])):
                    raise OutDirError(
                        f"--out {path}: in use by kvsim pid {holder['pid']} on {holder.get('host')} "
                        f"(lock file {lock}; remove it if that process is gone)") from None
                lock.unlink(missing_ok=True)  # stale: its process is dead
        raise OutDirError(f"--out {path}: could not take the lock {lock}")
    finally:
        tmp.unlink(missing_ok=True)


def _lock_holder(lock: Path) -> dict | None:
    try:
        data = json.loads(lock.read_text())
        return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None
    except (OSError, ValueError):
        return None


#: The commands that write a run manifest.
RUN_COMMANDS = ("replay", "live", "trace")


def is_kvsim_manifest(manifest: object) -> bool:
    """Whether ``manifest`` (a parsed ``run.json``) was written by :class:`RunDir`."""
    return (isinstance(manifest, dict) and manifest.get("command") in RUN_COMMANDS
            and "kvsim_version" in manifest and isinstance(manifest.get("inputs"), list))


def check_run_folder(path: Path) -> None:
    """Raise :class:`OutDirError` when ``path`` holds an entry under a name a run manages
    (``MANAGED``) but no ``run.json`` written by kvsim: the user's own files there are never
    replaced or removed."""
    path = Path(path)
    if is_kvsim_manifest(read_manifest(path)):
        return
    own = next((name for name in MANAGED if (path / name).exists() or (path / name).is_symlink()), None)
    if own is not None:
        raise OutDirError(f"--out {path}: holds {own} but is not a kvsim run folder (no {MANIFEST} "
                          "written by kvsim); choose another --out, kvsim does not replace it")


def clear_run(path: Path) -> None:
    """Remove what an earlier run wrote under the managed names (and leftover temp files).
    Only in a directory an earlier kvsim run wrote (its ``run.json``, see
    :func:`is_kvsim_manifest`); :func:`check_run_folder` refuses any other that holds them."""
    path = Path(path)
    if not is_kvsim_manifest(read_manifest(path)):
        return
    for name in MANAGED:
        p = Path(path) / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    for p in path.glob(f"*{TMP_MARK}*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def read_manifest(path: Path) -> dict | None:
    """The run manifest of an output directory, or None when there is none (or it is damaged)."""
    try:
        data = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvsim")
    except Exception:  # not installed (source checkout)
        return "unknown"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass
class RunDir:
    """A locked output directory and its manifest; use :meth:`open`, then :meth:`done` /
    :meth:`failed` per input and :meth:`finish` at the end (``with`` releases the lock)."""

    path: Path
    manifest: dict[str, Any]
    lock: Path
    completed: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, command: str, inputs: list[str], config: dict,
             resume: bool = False) -> RunDir:
        """Check and lock ``path``; start a fresh run (clearing the previous one) or, with
        ``resume``, keep the inputs a previous run with the same ``config`` completed."""
        path = Path(path)
        check_out_dir(path)
        try:
            path.mkdir(parents=True, exist_ok=True)
            lock = acquire_lock(path)
        except OSError as exc:  # e.g. a read-only file system that os.access did not reveal
            raise OutDirError(f"--out {path}: cannot write ({exc.strerror or exc})") from None
        try:
            check_run_folder(path)
            old = read_manifest(path)
            kept: dict[str, dict] = {}
            if resume and old is not None:
                if old.get("config") != config or old.get("command") != command:
                    raise OutDirError(f"--resume: {path / MANIFEST} was written by a run with "
                                      "other options; rerun without --resume to start fresh")
                kept = {k: v for k, v in old.get("completed", {}).items()
                        if k in inputs and _part_ok(path, v)}
            if not kept:
                clear_run(path)
            else:  # resumed: the combined outputs are rewritten at the end
                for name in COMBINED:
                    (path / name).unlink(missing_ok=True)
            run = cls(path, {"command": command, "argv": sys.argv, "kvsim_version": _version(),
                             "started": _now(), "ended": None, "status": "running",
                             "pid": os.getpid(), "config": config, "inputs": inputs,
                             "completed": kept, "failed": {}, "outputs_failed": {}},
                      lock, dict(kept))
            run._save()
            return run
        except BaseException:
            lock.unlink(missing_ok=True)
            raise

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.manifest["status"] == "running" and exc[0] is not None:
            self.finish("interrupted" if issubclass(exc[0], KeyboardInterrupt) else "failed")
        self.release()

    def release(self) -> None:
        holder = _lock_holder(self.lock)
        if holder is not None and holder["pid"] == os.getpid():
            self.lock.unlink(missing_ok=True)

    def _save(self) -> None:
        atomic_write_text(self.path / MANIFEST, json.dumps(self.manifest, indent=1, default=str))

    def part_path(self, key: str) -> Path:
        """``parts/<name>-<hash>.parquet``: the input's file name, made safe, and a hash of
        the whole key (two inputs of one name in different folders get two parts)."""
        name = "".join(c if c.isalnum() or c in "-_.=@" else "_" for c in Path(key).name)[:80]
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        return self.path / PARTS / f"{name}-{digest}.parquet"

    def done(self, key: str, frame: pl.DataFrame | None = None, **info: Any) -> None:
        """Record input ``key`` as complete; its results ``frame`` become a part file first."""
        entry = dict(info)
        if frame is not None:
            part = self.part_path(key)
            with atomic_file(part) as tmp:
                frame.write_parquet(tmp)
            entry["part"] = str(part.relative_to(self.path))
        self.completed[key] = entry
        self.manifest["completed"][key] = entry
        self.manifest["failed"].pop(key, None)
        self._save()

    def failed(self, key: str, message: str) -> None:
        self.manifest["failed"][key] = message
        self._save()

    def output_failed(self, name: str, message: str) -> None:
        """Record that a step after the inputs (``--simulate``, ``--plot``) failed."""
        self.manifest["outputs_failed"][name] = message
        self._save()

    def parts(self) -> pl.DataFrame | None:
        """Every completed input's results, in input order (None when there are none)."""
        frames = [pl.read_parquet(self.path / e["part"], glob=False)
                  for k in self.manifest["inputs"] if (e := self.completed.get(k)) and "part" in e]
        return pl.concat(frames, how="diagonal_relaxed") if frames else None

    def write_combined(self, frame: pl.DataFrame, name: str = "results.parquet") -> None:
        with atomic_file(self.path / name) as tmp:
            frame.write_parquet(tmp)

    def finish(self, status: str | None = None) -> str:
        """Close the manifest: ``complete`` when no input and no output step failed, else
        ``failed``."""
        broken = self.manifest["failed"] or self.manifest["outputs_failed"]
        self.manifest["status"] = status or ("failed" if broken else "complete")
        self.manifest["ended"] = _now()
        self._save()
        return self.manifest["status"]


def _part_ok(path: Path, entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    part = entry.get("part")
    return part is None or (Path(path) / str(part)).is_file()


def run_step_logs(path: Path) -> list[str] | None:
    """Names (relative to ``path``) of the step logs the run in ``run.json`` wrote, or None
    when ``path`` holds no run manifest."""
    manifest = read_manifest(path)
    if manifest is None:
        return None
    completed = manifest.get("completed")
    if not isinstance(completed, dict):
        return []
    return [s for e in completed.values() if isinstance(e, dict)
            for s in e.get("steps", []) if isinstance(s, str)]
