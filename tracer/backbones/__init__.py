"""Backbone adapters, one small module per model family behind :class:`Backbone`."""

from __future__ import annotations

import json
from pathlib import Path

from kvsim.tracer.backbones.base import Backbone, LoadOptions, Prepared, PromptSpec, resolve_path

#: Short names accepted by ``--model`` and the hub ids they stand for.
MODEL_ALIASES = {
    "voxtral-mini": ("voxtral", "mistralai/Voxtral-Mini-3B-2507"),
    "voxtral-small": ("voxtral", "mistralai/Voxtral-Small-24B-2507"),
    "qwen-omni": ("qwen-omni", "Qwen/Qwen2.5-Omni-3B"),
    "minivox": ("minivox", None),
}

#: config.json ``model_type`` -> family.
MODEL_TYPES = {
    "voxtral": "voxtral",
    "qwen2_5_omni_thinker": "qwen-omni",
    "qwen2_5_omni": "qwen-omni",
    "minivox": "minivox",
}


class BackboneError(Exception):
    """The model cannot be resolved or loaded; ``str()`` is one line."""


def family_of(path: str) -> str:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        raise BackboneError(f"{path}: no config.json (not a transformers checkpoint directory)")
    try:
        model_type = json.loads(cfg.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise BackboneError(f"{cfg}: invalid JSON ({exc.msg})") from None
    if model_type not in MODEL_TYPES:
        raise BackboneError(
            f"{cfg}: model_type {model_type!r} is not supported (known: {sorted(MODEL_TYPES)})"
        )
    return MODEL_TYPES[model_type]


def _class_for(family: str) -> type[Backbone]:
    if family == "voxtral":
        from kvsim.tracer.backbones.voxtral import VoxtralBackbone

        return VoxtralBackbone
    if family == "qwen-omni":
        from kvsim.tracer.backbones.qwen_omni import QwenOmniBackbone

        return QwenOmniBackbone
    if family == "minivox":
        from kvsim.tracer.backbones.minivox import MinivoxBackbone

        return MinivoxBackbone
    raise BackboneError(f"unknown model family {family!r}")


def resolve_model(model: str) -> tuple[str, str | None, str]:
    """(family, path or hub id, display name) of ``--model``, without loading anything."""
    if model in MODEL_ALIASES:
        family, path = MODEL_ALIASES[model]
        return family, path, model
    path = resolve_path(model)
    if not Path(path).exists():
        raise BackboneError(
            f"--model {model}: not a known name ({', '.join(MODEL_ALIASES)}) nor a directory"
        )
    return family_of(path), path, Path(path).name


def load_backbone(model: str, options: LoadOptions | None = None) -> Backbone:
    """Resolve ``model`` (a short name, a hub id or a local checkpoint directory) and load it."""
    options = options or LoadOptions()
    family, path, name = resolve_model(model)
    cls = _class_for(family)
    try:
        return cls(name, path, options)
    except BackboneError:
        raise
    except OSError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BackboneError(
            f"cannot load {path}: {first} (no hub access? pass a local checkpoint directory)"
        ) from None
    except (RuntimeError, ImportError) as exc:
        raise BackboneError(f"cannot load {path}: {str(exc).splitlines()[0]}") from None


__all__ = ["Backbone", "BackboneError", "LoadOptions", "Prepared", "PromptSpec", "load_backbone", "resolve_model"]
