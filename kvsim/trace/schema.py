"""Trace format v1: names, metadata dataclasses and their JSON (de)serialisation.

A trace is a directory ``NAME.kvtrace/`` holding

* ``meta.json`` -- :class:`TraceMeta` (schema version, model facts, prompt, texts,
  provenance, and a manifest of the other files with their byte size and SHA-256);
* ``tensors.safetensors`` -- ``keys`` (L, H_kv, N, D) and ``queries`` (L, H_q, N_q, D) in
  the storage dtype ``model.dtype`` (float16 or float32), post-RoPE; ``query_positions``
  (N_q,) int64, strictly increasing, holding at least every answer query (``n_prefill - 1``
  and every decode position); optionally ``values`` (L, H_kv, N, D);
* ``positions.parquet`` -- one row per position (see :data:`POSITION_COLUMNS`);
* ``heads.json`` (optional) -- per-KV-head calibration scores, same format as the file that
  ``kvsim calibrate`` writes (see :mod:`kvsim.trace.heads`).

Decode step ``j`` (``0 <= j < n_decode``) is the forward pass of the token at position
``n_prefill + j``; its query attends keys ``0 .. n_prefill + j`` (causal). The prompt's last
position is the query that produced the first answer token ("prefill attention" in WnW §2.1).
"""

from __future__ import annotations

import math
import re
import reprlib
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

#: The files a trace may list in its manifest (``meta.json`` itself is not listed).
MEMBER_FILES = (TENSORS_FILE, POSITIONS_FILE, HEADS_FILE)

#: The tensors ``tensors.safetensors`` may hold.
TENSOR_NAMES = ("keys", "queries", "query_positions", "values")

#: ``model.dtype`` values: the storage dtype of keys, queries and values.
STORAGE_DTYPES = ("float16", "float32")

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


_MISSING = object()
_FIELD_LIMIT = 120  # a hostile key is cut, the file and message are kept whole
_SHA256 = re.compile(r"[0-9a-f]{64}")
_JSON_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer",
                    float: "a number", bool: "true/false", type(None): "null"}


class TraceError(Exception):
    """A trace is missing, corrupt or inconsistent. ``str()`` is one line naming the file and
    the field: ``<path>: <field>: <what is wrong>``. Control characters (a newline in a
    directory name or in a hostile header key) are escaped so that the line stays one line."""

    def __init__(self, file: str, field_name: str, message: str) -> None:
        self.file = one_line(str(file))
        self.field = one_line(str(field_name))[:_FIELD_LIMIT]
        self.message = one_line(str(message))
        super().__init__(f"{self.file}: {self.field}: {self.message}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:  # survives a process pool
        return (type(self), (self.file, self.field, self.message))


def one_line(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x00``, ...)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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
            raise TraceError(file, "schema", f"expected {SCHEMA_NAME!r}, got {_short(raw.get('schema'))}")
        version = raw.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise TraceError(file, "schema_version",
                             f"unsupported version {_short(version)} (this kvsim reads version {SCHEMA_VERSION})")
        f = _Fields(raw, file)
        meta = cls(
            model=_model_facts(_Fields(f.get("model", dict), file, "model.")),
            n_positions=f.positive_int("n_positions"),
            n_prefill=f.positive_int("n_prefill"),
            n_decode=f.nonneg_int("n_decode"),
            prompt=f.get("prompt", str, ""),
            generated_text=f.get("generated_text", str, ""),
            reference_text=f.get("reference_text", (str, type(None)), None),
            has_values=f.get("has_values", bool, False),
            has_head_scores=f.get("has_head_scores", bool, False),
            input_transform=f.get("input_transform", (dict, type(None)), None),
            audio=f.get("audio", (dict, type(None)), None) or {},
            provenance=f.get("provenance", (dict, type(None)), None) or {},
            files=_manifest(f.get("files", dict), file),
        )
        if meta.n_prefill + meta.n_decode != meta.n_positions:
            raise TraceError(
                file,
                "n_positions",
                f"{meta.n_positions} != n_prefill {meta.n_prefill} + n_decode {meta.n_decode}",
            )
        return meta


class _Fields:
    """Typed access to the members of one JSON object; errors name ``prefix + key``."""

    def __init__(self, raw: dict, file: str, prefix: str = "") -> None:
        self.raw, self.file, self.prefix = raw, file, prefix

    def error(self, key: str, message: str) -> TraceError:
        return TraceError(self.file, self.prefix + key, message)

    def get(self, key: str, typ: Any, default: Any = _MISSING) -> Any:
        """``raw[key]`` checked to be of ``typ`` (bool is never an int); ``default`` when the
        key is absent, or an error when there is no default."""
        if key not in self.raw:
            if default is _MISSING:
                raise self.error(key, "missing")
            return default
        value = self.raw[key]
        types = typ if isinstance(typ, tuple) else (typ,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join(_JSON_TYPE_NAMES.get(t, t.__name__) for t in types)
            raise self.error(key, f"expected {want}, got {_short(value)}")
        return value

    def positive_int(self, key: str) -> int:
        value = self.get(key, int)
        if value <= 0:
            raise self.error(key, f"must be positive, got {value}")
        return value

    def nonneg_int(self, key: str) -> int:
        value = self.get(key, int)
        if value < 0:
            raise self.error(key, f"must be >= 0, got {value}")
        return value

    def positive_float(self, key: str) -> float:
        raw = self.get(key, (int, float))
        try:
            value = float(raw)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value) or value <= 0:
            raise self.error(key, f"must be a finite positive number, got {_short(raw)}")
        return value


def _model_facts(f: _Fields) -> ModelFacts:
    model = ModelFacts(
        name=f.get("name", str),
        n_layers=f.positive_int("n_layers"),
        n_q_heads=f.positive_int("n_q_heads"),
        n_kv_heads=f.positive_int("n_kv_heads"),
        head_dim=f.positive_int("head_dim"),
        audio_tokens_per_s=f.positive_float("audio_tokens_per_s"),
        dtype=f.get("dtype", str, "float16"),
    )
    if model.dtype not in STORAGE_DTYPES:
        raise f.error("dtype", f"unknown storage dtype {_short(model.dtype)} (known: {', '.join(STORAGE_DTYPES)})")
    if model.n_q_heads % model.n_kv_heads:
        raise f.error("n_q_heads", "not a multiple of model.n_kv_heads")
    return model


def _manifest(raw: dict, file: str) -> dict[str, dict[str, Any]]:
    """Check the ``files`` manifest: plain names of the format's files, each with an integer
    size and a hex SHA-256 (or null: not checksummed)."""
    for name, entry in raw.items():
        field_name = f"files.{name}"
        check_member_name(name, file, field_name)
        if not isinstance(entry, dict):
            raise TraceError(file, field_name, f"expected an object, got {_short(entry)}")
        f = _Fields(entry, file, field_name + ".")
        f.nonneg_int("bytes")
        digest = f.get("sha256", (str, type(None)), None)
        if digest is not None and not _SHA256.fullmatch(digest):
            raise f.error("sha256", "not 64 lowercase hex digits")
    return raw


def check_member_name(name: str, file: str, field_name: str) -> None:
    """A manifest entry must be one of the format's file names, never a path."""
    if not name or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise TraceError(file, field_name, "not a plain file name inside the trace directory")
    if name not in MEMBER_FILES:
        raise TraceError(file, field_name, f"not a file of the trace format (expected {', '.join(MEMBER_FILES)})")


def _short(value: Any) -> str:
    """A JSON value for an error message: its repr, bounded in length and depth."""
    return reprlib.repr(value)
