"""Name -> policy class registry, filled by the ``@register`` decorator of each policy file."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from kvsim.policies.base import Policy

_REGISTRY: dict[str, type[Policy]] = {}
_DISCOVERED = False


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    from kvsim import policies
    skip = {"base", "registry", "params", "allocation"}
    for mod in pkgutil.iter_modules(policies.__path__):
        if mod.name not in skip and not mod.name.startswith("_"):
            importlib.import_module(f"kvsim.policies.{mod.name}")
    _DISCOVERED = True


def available(include_private: bool = False) -> dict[str, type[Policy]]:
    """All registered policies, sorted by name. Names starting with ``_`` (test doubles) are
    listed only with ``include_private``; :func:`get` finds them either way."""
    _discover()
    return dict(sorted((k, v) for k, v in _REGISTRY.items() if include_private or not k.startswith("_")))


def get(name: str) -> type[Policy]:
    """The policy class called ``name``; a clear error listing the choices otherwise."""
    pols = available(include_private=True)
    if name not in pols:
        raise KeyError(f"unknown policy {name!r}; available: {', '.join(available())}")
    return pols[name]


def make(name: str, budget: float, **params: Any) -> Policy:
    """Instantiate policy ``name`` at target retention ``budget`` with hyperparameters."""
    cls = get(name)
    known = cls.hyperparameters()
    bad = sorted(set(params) - set(known))
    if bad:
        raise ValueError(
            f"policy {name!r} has no hyperparameter {', '.join(bad)}; it has: "
            f"{', '.join(known) or '(none)'}"
        )
    return cls(budget=budget, **params)
