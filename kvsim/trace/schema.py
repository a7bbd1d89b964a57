"""Trace format v1: names, metadata dataclasses and their JSON (de)serialisation.

A trace is a directory ``NAME.kvtrace/`` holding

* ``meta.json`` -- :class:`TraceMeta` (schema version, model facts, prompt, texts,
  provenance, and a manifest of the other files with their byte size and SHA-256);
* ``tensors.safetensors`` -- ``keys`` (L, H_kv, N, D) and ``queries`` (L, H_q, N_q, D) in
  float16, post-RoPE; ``query_positions`` (N_q,) int64; optionally ``values`` (L, H_kv, N, D);
* ``positions.parquet`` -- one row per position (see :data:`POSITION_COLUMNS`);
* ``heads.json`` (optional) -- per-KV-head calibration scores, same format as the file that
  ``kvsim calibrate`` writes (see :mod:`kvsim.trace.heads`).

Decode step ``j`` (``0 <= j < n_decode``) is the forward pass of the token at position
``n_prefill + j``; its query attends keys ``0 .. n_prefill + j`` (causal). The prompt's last
position is the query that produced the first answer token ("prefill attention" in WnW §2.1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

SCHEMA_NAME = "kvsim.trace"
SCHEMA_VERSION = 1
TRACE_SUFFIX = ".kvtrace"

META_FILE = "meta.json"
TENSORS_FILE = "tensors.safetensors"
POSITIONS_FILE = "positions.parquet"
HEADS_FILE = "heads.json"

#: Observation window: the trace stores the queries of the last ``OBSERVATION_WINDOW`` prompt
#: positions (audio positions included when fewer text positions follow the audio). 32 is
#: AudioKV's observation window (WnW App. F) and SnapKV's default window.
OBSERVATION_WINDOW = 32


def observation_window(n_prompt: int, size: int = OBSERVATION_WINDOW) -> range:
    """Prompt positions of the observation window: the last ``size`` of ``n_prompt``."""
    if size < 1:
        raise ValueError(f"observation window must be >= 1 position, got {size}")
    return range(max(0, n_prompt - size), n_prompt)

POSITION_KINDS = ("system", "text", "audio", "generated")

#: Column -> polars dtype of ``positions.parquet``.
POSITION_COLUMNS: dict[str, pl.DataType] = {
    "position": pl.Int64(),
    "kind": pl.Utf8(),
    "token_id": pl.Int64(),
    "audio_start_s": pl.Float64(),  # audio positions: time span of the token
    "audio_end_s": pl.Float64(),
    "word": pl.Utf8(),  # generated positions: the word this token belongs to, when known
    "word_start_s": pl.Float64(),
    "word_end_s": pl.Float64(),
    "query_index": pl.Int64(),  # row in ``queries`` for this position, -1 when not stored
}

#: Optional columns: checked for type when present.
OPTIONAL_POSITION_COLUMNS: dict[str, pl.DataType] = {
    "word_confidence": pl.Float64(),  # aligner confidence of the word (voice-score filter)
    # audio positions the encoder produced from padding beyond the end of the input (Whisper-
    # style 30 s windows); absent in traces recorded before it was kept: unknown
    "padding": pl.Boolean(),
}


class TraceError(Exception):
    """A trace is missing, corrupt or inconsistent. ``str()`` is one line naming the file and
    the field: ``<path>: <field>: <what is wrong>``."""

    def __init__(self, file: str, field_name: str, message: str) -> None:
        self.file = file
        self.field = field_name
        self.message = message
        super().__init__(f"{file}: {field_name}: {message}")


@dataclass(frozen=True)
class ModelFacts:
    """The backbone a trace was recorded from."""

    name: str
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    audio_tokens_per_s: float
    dtype: str = "float16"  #: storage dtype of the tensors in the trace


@dataclass
class TraceMeta:
    """Contents of ``meta.json``."""

    model: ModelFacts
    n_positions: int
    n_prefill: int
    n_decode: int
    prompt: str = ""
    generated_text: str = ""
    reference_text: str | None = None
    has_values: bool = False
    has_head_scores: bool = False
    #: Which input transform (VoxZip stage 1, AffPool, ...) produced the input, if any.
    input_transform: dict[str, Any] | None = None
    audio: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    #: file name -> {"bytes": int, "sha256": str}; filled by the writer.
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    schema: str = SCHEMA_NAME
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, file: str) -> TraceMeta:
        """Parse and type-check ``meta.json``; a :class:`TraceError` names the bad field."""
        if not isinstance(raw, dict):
            raise TraceError(file, "<root>", "expected a JSON object")
        if raw.get("schema") != SCHEMA_NAME:
            raise TraceError(file, "schema", f"expected {SCHEMA_NAME!r}, got {raw.get('schema')!r}")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(
                file,
                "schema_version",
                f"unsupported version {version!r} (this kvsim reads version {SCHEMA_VERSION})",
            )
        model_raw = _require(raw, "model", dict, file)
        model = ModelFacts(
            name=_require(model_raw, "name", str, file, "model."),
            n_layers=_positive_int(model_raw, "n_layers", file, "model."),
            n_q_heads=_positive_int(model_raw, "n_q_heads", file, "model."),
            n_kv_heads=_positive_int(model_raw, "n_kv_heads", file, "model."),
            head_dim=_positive_int(model_raw, "head_dim", file, "model."),
            audio_tokens_per_s=float(
                _require(model_raw, "audio_tokens_per_s", (int, float), file, "model.")
            ),
            dtype=model_raw.get("dtype", "float16"),
        )
        if model.n_q_heads % model.n_kv_heads:
            raise TraceError(file, "model.n_q_heads", "not a multiple of model.n_kv_heads")
        if model.audio_tokens_per_s <= 0:
            raise TraceError(file, "model.audio_tokens_per_s", "must be positive")
        meta = cls(
            model=model,
            n_positions=_positive_int(raw, "n_positions", file),
            n_prefill=_positive_int(raw, "n_prefill", file),
            n_decode=_nonneg_int(raw, "n_decode", file),
            prompt=raw.get("prompt", ""),
            generated_text=raw.get("generated_text", ""),
            reference_text=raw.get("reference_text"),
            has_values=bool(raw.get("has_values", False)),
            has_head_scores=bool(raw.get("has_head_scores", False)),
            input_transform=raw.get("input_transform"),
            audio=raw.get("audio") or {},
            provenance=raw.get("provenance") or {},
            files=_require(raw, "files", dict, file),
        )
        if meta.n_prefill + meta.n_decode != meta.n_positions:
            raise TraceError(
                file,
                "n_positions",
                f"{meta.n_positions} != n_prefill {meta.n_prefill} + n_decode {meta.n_decode}",
            )
        return meta


def _require(raw: dict, key: str, typ: Any, file: str, prefix: str = "") -> Any:
    if key not in raw:
        raise TraceError(file, prefix + key, "missing")
    value = raw[key]
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        raise TraceError(file, prefix + key, f"wrong type {type(value).__name__}")
    return value


def _positive_int(raw: dict, key: str, file: str, prefix: str = "") -> int:
    value = _require(raw, key, int, file, prefix)
    if value <= 0:
        raise TraceError(file, prefix + key, f"must be positive, got {value}")
    return value


def _nonneg_int(raw: dict, key: str, file: str, prefix: str = "") -> int:
    value = _require(raw, key, int, file, prefix)
    if value < 0:
        raise TraceError(file, prefix + key, f"must be >= 0, got {value}")
    return value
