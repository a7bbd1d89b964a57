"""The per-head calibration file (``heads.json``): WnW voice score and head sensitivity.

The same JSON is written by ``kvsim calibrate --out heads.json``, read by ``--calibration``
and stored inside traces. Format::

    {"format": "kvsim.heads", "version": 1, "model": "...", "n_layers": L, "n_kv_heads": H,
     "voice_score": [[...H floats...] x L], "sensitivity": [[...] x L],
     "provenance": {...}}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvsim.core.shapes import HeadScores
from kvsim.trace.atomic import atomic_write_text
from kvsim.trace.schema import TraceError

HEADS_FORMAT = "kvsim.heads"
HEADS_VERSION = 1


def heads_to_json(
    scores: HeadScores, model: str, provenance: dict[str, Any] | None = None
) -> dict[str, Any]:
    n_layers, n_kv = scores.voice_score.shape
    return {
        "format": HEADS_FORMAT,
        "version": HEADS_VERSION,
        "model": model,
        "n_layers": n_layers,
        "n_kv_heads": n_kv,
        "source": scores.source,
        "voice_score": scores.voice_score.tolist(),
        "sensitivity": scores.sensitivity.tolist(),
        "provenance": provenance or {},
    }


def write_heads(
    path: str | Path, scores: HeadScores, model: str, provenance: dict[str, Any] | None = None
) -> None:
    """Write a calibration file atomically."""
    atomic_write_text(Path(path), json.dumps(heads_to_json(scores, model, provenance), indent=1))


def heads_from_json(raw: Any, file: str) -> HeadScores:
    """Parse a calibration JSON object; :class:`TraceError` names the bad field."""
    if not isinstance(raw, dict) or raw.get("format") != HEADS_FORMAT:
        raise TraceError(file, "format", f"not a {HEADS_FORMAT} file")
    if raw.get("version") != HEADS_VERSION:
        raise TraceError(file, "version", f"unsupported version {raw.get('version')!r}")
    arrays = {}
    for key in ("voice_score", "sensitivity"):
        try:
            arr = np.asarray(raw[key], dtype=np.float64)
        except KeyError:
            raise TraceError(file, key, "missing") from None
        except (TypeError, ValueError) as exc:
            raise TraceError(file, key, f"not a numeric matrix ({exc})") from None
        want = (raw.get("n_layers"), raw.get("n_kv_heads"))
        if arr.shape != want:
            raise TraceError(file, key, f"shape {arr.shape} != (n_layers, n_kv_heads) {want}")
        if not np.isfinite(arr).all():
            raise TraceError(file, key, "contains NaN or inf")
        if (arr < 0).any():
            raise TraceError(file, key, "contains negative values")
        arrays[key] = arr
    return HeadScores(arrays["voice_score"], arrays["sensitivity"], source=raw.get("source", file))


def read_heads(path: str | Path) -> HeadScores:
    """Read a calibration file written by :func:`write_heads` (a regular file, read with a
    size bound and without blocking: a FIFO or ``/dev/zero`` is refused, not waited on)."""
    from kvsim.trace.members import MAX_JSON_BYTES, read_member

    path = Path(path)
    try:
        raw = json.loads(read_member(path, MAX_JSON_BYTES))
    except json.JSONDecodeError as exc:
        raise TraceError(str(path), "<json>", f"invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except (ValueError, RecursionError):
        raise TraceError(str(path), "<json>", "invalid JSON (not UTF-8 or nested too deeply)") from None
    return heads_from_json(raw, str(path))
