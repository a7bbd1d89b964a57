"""Name -> policy class registry, filled by the ``@register`` decorator of each policy file,
and by :func:`load` for a user's policy given as ``package.module:ClassName``."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import sys
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


def load(path: str) -> type[Policy]:
    """Import a user's policy class from ``package.module:ClassName`` and register it under
    its ``name`` (no fork of kvsim needed). The module is found on ``sys.path``, the current
    directory included. Every failure is a one-line ``ValueError`` naming ``path``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"policy {path!r}: write a user policy as package.module:ClassName")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"policy {path!r}: module {exc.name!r} not found (run from the folder "
                         "that holds it, or put that folder on PYTHONPATH)") from None
    except Exception as exc:  # the user's module itself fails: say how, in one line
        raise ValueError(f"policy {path!r}: importing {module_name} failed: "
                         f"{type(exc).__name__}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"policy {path!r}: module {module_name} has no attribute {attr!r}")
    return admit(cls, f"policy {path!r}")


def admit(cls: Any, where: str = "") -> type[Policy]:
    """Register a user's policy class after checking it is a concrete, named Policy subclass
    whose name no other class has; a one-line ``ValueError`` (prefixed ``where``) otherwise."""
    where = where or f"policy {getattr(cls, '__qualname__', cls)!r}"
    label = getattr(cls, "__qualname__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"{where}: {label} is not a subclass of kvsim.policies.Policy")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"{where}: {label} is abstract (implement {missing})")
    if not cls.name:
        raise ValueError(f"{where}: {label} has no class attribute `name`")
    taken = available(include_private=True).get(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"{where}: the name {cls.name!r} is taken by "
                         f"{taken.__module__}.{taken.__qualname__}; give {label} another `name`")
    return register(cls)


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
