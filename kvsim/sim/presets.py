"""Hardware, model and host-runtime presets: TOML data files with a cited source per number.

A preset file has one table of values and a ``[sources]`` table that names where every numeric
value comes from (a URL, a datasheet, a measurement command, or an
explicit ``assumption: ...``). Loading validates the file: every required field is present,
numeric fields are positive (fractions in (0, 1]), units are implied by the field-name suffix
(``_gib``, ``_gbps``, ``_us``, ``_tflops``) and a value may instead be written with a unit
(``"3.35 TB/s"``, ``"2 ms"``, ``"141 GB"``), converted on load; every number has a source. Errors are one line
naming the file and the field (:class:`PresetError`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

GIB = 1024**3


class PresetError(ValueError):
    """A preset file is missing, malformed, or holds an invalid value (one-line message)."""


@dataclass(frozen=True)
class GpuPreset:
    """One GPU and its host link (docs/simulator.md: HBM and PCIe entities).

    Units: capacities in GiB, bandwidths in GB/s (1e9 B/s), times in microseconds.
    """

    name: str
    description: str
    hbm_capacity_gib: float
    reserved_gib: float  # CUDA context + allocator reserve, not usable for tensors
    hbm_bandwidth_gbps: float
    hbm_efficiency: float  # achieved fraction on streaming (weight) reads
    kv_read_efficiency: float  # achieved fraction on KV-cache reads during decode attention
    peak_tflops: float  # dense bf16 tensor-core peak
    flops_efficiency: float
    min_kernel_us: float  # shortest a kernel occupies the compute stream
    kernel_launch_us: float  # host cost of cudaLaunchKernel
    graph_launch_us: float  # host cost of one cudaGraphLaunch
    pcie_gen: int
    pcie_latency_us: float  # per-transfer latency alpha (DMA setup + completion)
    pcie_h2d_pinned_gbps: float
    pcie_d2h_pinned_gbps: float
    pcie_h2d_pageable_gbps: float
    pcie_d2h_pageable_gbps: float
    memcpy_api_us: float  # host cost of one cudaMemcpyAsync call
    pageable_extra_us: float  # extra host+latency cost of a pageable (staged) copy
    source_file: str = ""

    @property
    def hbm_capacity_bytes(self) -> int:
        return int(self.hbm_capacity_gib * GIB)

    @property
    def usable_bytes(self) -> int:
        return int((self.hbm_capacity_gib - self.reserved_gib) * GIB)


@dataclass(frozen=True)
class ModelPreset:
    """A speech LLM's decoder geometry and parameter counts (WnW §2 notation)."""

    name: str
    description: str
    aliases: tuple[str, ...]
    total_params_b: float  # everything resident on GPU (audio encoder, projector, decoder)
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    audio_tokens_per_s: float
    source_file: str = ""

    @property
    def weight_bytes(self) -> int:
        return int(self.total_params_b * 1e9 * self.dtype_bytes)

    @property
    def lm_head_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def layer_weight_bytes(self) -> int:
        """Bytes of one decoder layer's weights (attention + MLP projections)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.n_q_heads * d * 2 + h * self.n_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return (attn + mlp) * self.dtype_bytes

    @property
    def kv_bytes_per_head_token(self) -> int:
        return 2 * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes of one position across all layers and KV-heads."""
        return self.n_layers * self.n_kv_heads * self.kv_bytes_per_head_token


@dataclass(frozen=True)
class RuntimePreset:
    """Host-side cost of one decode step for a serving runtime (eager HF, CUDA graphs)."""

    name: str
    description: str
    cuda_graphs: bool
    ops_per_layer: float  # dispatched ATen operators per decoder layer per step
    kernels_per_layer: float  # of which launch a kernel
    host_us_per_op: float  # Python + dispatcher cost per operator, excluding the launch
    step_ops: float  # operators outside the layers (embedding, norm, LM head, sampling)
    step_fixed_us: float  # generate-loop overhead per step (logits processors, stopping)
    cache_copy_factor: float  # resident KV bytes moved per step by cache growth (torch.cat: 2)
    host_gather_gbps: float  # host memcpy rate gathering scattered KV into a copy buffer
    source_file: str = ""


_KIND_CLASS = {"gpus": GpuPreset, "models": ModelPreset, "runtimes": RuntimePreset}
_FRACTIONS = {"hbm_efficiency", "kv_read_efficiency", "flops_efficiency"}
_ALLOW_ZERO = {"reserved_gib", "step_fixed_us", "step_ops", "pageable_extra_us", "cache_copy_factor"}
_STR_FIELDS = {"name", "description", "source_file"}


#: field-name suffix -> {unit written in a value string: factor to the field's unit}
_UNITS: dict[str, dict[str, float]] = {
    "_gib": {"gib": 1.0, "mib": 1 / 1024, "tib": 1024.0, "gb": 1e9 / GIB, "tb": 1e12 / GIB},
    "_gbps": {"gb/s": 1.0, "tb/s": 1e3, "mb/s": 1e-3, "gib/s": GIB / 1e9},
    "_us": {"us": 1.0, "µs": 1.0, "ns": 1e-3, "ms": 1e3, "s": 1e6},
    "_tflops": {"tflops": 1.0, "pflops": 1e3, "gflops": 1e-3},
}


def _parse_unit(where: str, name: str, value: Any) -> Any:
    """``"3.35 TB/s"`` -> 3350.0 for a ``*_gbps`` field; numbers pass through unchanged."""
    if not isinstance(value, str):
        return value
    suffix = next((s for s in _UNITS if name.endswith(s)), None)
    parts = value.strip().split()
    if suffix is None or len(parts) != 2:
        raise PresetError(f"{where}: expected a number, got {value!r}")
    table = _UNITS[suffix]
    unit = parts[1].lower()
    if unit not in table:
        raise PresetError(
            f"{where}: unknown unit {parts[1]!r} (use a number in {suffix[1:]} or one of "
            f"{', '.join(table)})"
        )
    try:
        return float(parts[0]) * table[unit]
    except ValueError:
        raise PresetError(f"{where}: expected a number, got {value!r}") from None


def _check_value(path: str, name: str, value: Any, typ: Any) -> Any:
    where = f"{path}: field {name!r}"
    value = _parse_unit(where, name, value)
    if typ in ("bool", bool):
        if not isinstance(value, bool):
            raise PresetError(f"{where}: expected true/false, got {value!r}")
        return value
    if typ in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise PresetError(f"{where}: expected an integer, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise PresetError(f"{where}: expected a number, got {value!r}")
    if name in _FRACTIONS and not (0 < value <= 1):
        raise PresetError(f"{where}: must be a fraction in (0, 1], got {value!r}")
    if name in _ALLOW_ZERO:
        if value < 0:
            raise PresetError(f"{where}: must be >= 0, got {value!r}")
    elif value <= 0:
        raise PresetError(f"{where}: must be > 0, got {value!r}")
    return float(value) if typ in ("float", float) else value


def parse_preset(kind: str, data: dict[str, Any], path: str) -> Any:
    """Validate a parsed preset table and build the dataclass for ``kind``.

    Raises :class:`PresetError` naming ``path`` and the offending field.
    """
    cls = _KIND_CLASS[kind]
    sources = data.get("sources")
    if not isinstance(sources, dict):
        raise PresetError(f"{path}: missing [sources] table (every number needs a cited source)")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known - {"sources", "environment"})
    if unknown:
        raise PresetError(f"{path}: field {unknown[0]!r}: unknown field for a {kind[:-1]} preset")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name == "source_file":
            continue
        if f.name not in data:
            if f.name == "aliases":
                kwargs["aliases"] = ()
                continue
            raise PresetError(f"{path}: field {f.name!r}: missing")
        value = data[f.name]
        if f.name in _STR_FIELDS:
            if not isinstance(value, str) or not value:
                raise PresetError(f"{path}: field {f.name!r}: expected a non-empty string")
            kwargs[f.name] = value
            continue
        if f.name == "aliases":
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise PresetError(f"{path}: field 'aliases': expected a list of strings")
            kwargs[f.name] = tuple(value)
            continue
        kwargs[f.name] = _check_value(path, f.name, value, f.type)
        src = sources.get(f.name)
        if not isinstance(src, str) or not src.strip():
            raise PresetError(f"{path}: field {f.name!r}: no source in [sources]")
    return cls(**kwargs, source_file=path)


def load_preset_file(kind: str, path: str | Path) -> Any:
    """Load and validate one preset file of ``kind`` ('gpus', 'models' or 'runtimes')."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise PresetError(f"{p}: no such preset file") from None
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{p}: not valid TOML ({exc})") from None
    return parse_preset(kind, data, str(p))


def _preset_dir(kind: str) -> Path:
    return Path(str(resources.files("kvsim.presets") / kind))


def list_presets(kind: str) -> list[str]:
    """Names of the shipped presets of ``kind``."""
    return sorted(p.stem for p in _preset_dir(kind).glob("*.toml"))


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").split("/")[-1]


def load_preset(kind: str, name: str) -> Any:
    """Load a shipped preset by name, alias (models) or path to a ``.toml`` file."""
    if name.endswith(".toml") or "/" in name and Path(name).exists():
        return load_preset_file(kind, name)
    key = _norm(name)
    for stem in list_presets(kind):
        if _norm(stem) == key:
            return load_preset_file(kind, _preset_dir(kind) / f"{stem}.toml")
    if kind == "models":
        for stem in list_presets(kind):
            preset = load_preset_file(kind, _preset_dir(kind) / f"{stem}.toml")
            if key in {_norm(a) for a in preset.aliases}:
                return preset
    raise PresetError(
        f"unknown {kind[:-1]} preset {name!r}; available: {', '.join(list_presets(kind))}"
    )


def gpu_preset(gpu: str | GpuPreset) -> GpuPreset:
    return gpu if isinstance(gpu, GpuPreset) else load_preset("gpus", gpu)


def model_preset(model: str | ModelPreset) -> ModelPreset:
    return model if isinstance(model, ModelPreset) else load_preset("models", model)


def runtime_preset(rt: str | RuntimePreset) -> RuntimePreset:
    return rt if isinstance(rt, RuntimePreset) else load_preset("runtimes", rt)
