"""Parsing of the arguments the CLI commands share: comma-separated lists, policies, budgets."""

from __future__ import annotations

import ast
from pathlib import Path

from kvsim.commands._options import OptionError, check_range
from kvsim.policies import registry
from kvsim.policies.spec import PolicySpec


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_policies(args: list[str], budget: float) -> list[PolicySpec]:
    """``["full,snapkv:window=16", "wnw"]`` -> specs at ``budget``. ``all`` = every policy.

    A user's policy is ``package.module:ClassName`` (then ``:key=value`` pairs): imported,
    checked to be a Policy subclass and registered under its ``name``."""
    specs: list[PolicySpec] = []
    for item in split_items(args, "-p/--policy", "policy"):
        name, *pairs = item.split(":")
        source = None
        if pairs and "=" not in pairs[0] and name not in registry.available():
            source = f"{name}:{pairs.pop(0)}"
            name = registry.load(source).name
        names = list(registry.available()) if name == "all" else [name]
        params = _hyperparameters(item, pairs)
        for n in names:
            specs.append(_checked_spec(item, n, budget, params, source))
    return specs


def _checked_spec(item: str, name: str, budget: float, params: dict,
                  source: str | None) -> PolicySpec:
    """The spec of ``name`` with ``params``, its hyperparameters checked by building the
    policy once, so that a bad value is one error before any work (not one per trace)."""
    try:
        cls = registry.get(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    unknown = set(params) - set(cls.hyperparameters())
    if unknown:
        raise ValueError(f"policy {name!r} has no hyperparameter {', '.join(sorted(unknown))}; "
                         f"it has: {', '.join(cls.hyperparameters()) or '(none)'}")
    try:
        cls(budget=1.0, **params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"-p {item}: {exc}") from None
    return PolicySpec(name, budget, params, source)


def _hyperparameters(item: str, pairs: list[str]) -> dict:
    """``["window=16", "pooling=max"]`` -> ``{"window": 16, "pooling": "max"}``."""
    params = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"bad hyperparameter {pair!r} in {item!r}; use name:key=value")
        k, v = pair.split("=", 1)
        if k in params:
            raise ValueError(f"-p {item}: {k} given twice")
        params[k] = _value(v)
    return params


def parse_budgets(text: str) -> list[float]:
    """``"0.2,0.4"`` (``-b``/``--budget``) -> ``[0.2, 0.4]``, each in (0, 1]; ValueError naming
    the option on anything else (no budget, an empty item, a non-number, one out of range)."""
    out = []
    for item in split_items([text], "-b/--budget", "budget"):
        try:
            b = float(item)
        except ValueError:
            raise ValueError(f"-b/--budget {item!r}: not a number") from None
        check_range("-b/--budget", b, 0, 1, low_open=True)
        out.append(b)
    return out


def split_items(args: list[str], flag: str, what: str) -> list[str]:
    """The comma-separated items of an option's values ``args``, stripped. OptionError naming
    ``flag`` when there is no item at all (``-p ''``, ``-p ,``) or an empty one among others
    (``-b 0.2,,0.4``: a mistyped list is not read as a shorter one)."""
    per_arg = [[x.strip() for x in arg.split(",")] for arg in args]
    if not any(x for items in per_arg for x in items):
        raise OptionError(f"no {what} given ({flag})")
    for arg, items in zip(args, per_arg, strict=True):
        if not all(items):
            raise OptionError(f"{flag} {arg!r}: empty item (two commas in a row, or one at an end)")
    return [x for items in per_arg for x in items]


def option_items(values: str | list[str] | None, flag: str, what: str = "value") -> list[str]:
    """The comma-separated items of an optional option, given once (``values`` a string) or
    repeated (a list): ``[]`` when it was not given at all, else `split_items`, so that a list
    given but empty (``--gpu ''``, ``--ids ,``) or with a hole is an OptionError naming
    ``flag``, never a silent fall back to the default."""
    if values is None:
        return []
    args = [values] if isinstance(values, str) else list(values)
    return split_items(args, flag, what) if args else []


def default_trace_dir() -> Path:
    """The shipped ``traces/`` folder of a source checkout."""
    here = Path(__file__).resolve().parent.parent / "traces"
    if not here.is_dir():
        raise FileNotFoundError("no traces given and no shipped traces/ folder next to the kvsim package")
    return here
