"""Range checks of policy hyperparameters: one helper, one message format.

Every policy validates its fields in ``__post_init__`` with these functions, so that a bad
value on the command line (``snapkv:window=0``) is one line naming the policy, the field,
the valid range and the value given, e.g. ``snapkv: window must be >= 1, got 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any


def _fail(policy: str, name: str, what: str, value: Any) -> None:
    raise ValueError(f"{policy}: {name} must be {what}, got {value!r}")


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    return f"{'<' if hi_open else '<='} {hi:g}"


def _check_range(policy: str, name: str, value: Any, lo: float | None, hi: float | None,
                 lo_open: bool, hi_open: bool) -> None:
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and (value >= hi if hi_open else value > hi)
    if too_low or too_high:
        _fail(policy, name, _range_text(lo, hi, lo_open, hi_open), value)


def require_int(policy: str, name: str, value: Any, *, lo: int | None = None,
                hi: int | None = None, allow_none: bool = False) -> None:
    """``value`` is an integer (not a bool) in ``[lo, hi]`` (either bound optional)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Integral):
        _fail(policy, name, "an integer" + (" or None" if allow_none else ""), value)
    _check_range(policy, name, value, lo, hi, False, False)


def require_real(policy: str, name: str, value: Any, *, lo: float | None = None,
                 hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
                 allow_none: bool = False) -> None:
    """``value`` is a finite real number in the given (open or closed) range."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Real) or value != value:
        _fail(policy, name, "a number" + (" or None" if allow_none else ""), value)
    if abs(float(value)) == float("inf"):
        _fail(policy, name, "finite", value)
    _check_range(policy, name, value, lo, hi, lo_open, hi_open)


def require_choice(policy: str, name: str, value: Any, choices: Sequence[Any]) -> None:
    """``value`` is one of ``choices``."""
    if value not in tuple(choices):
        _fail(policy, name, f"one of {tuple(choices)}", value)


def require_bool(policy: str, name: str, value: Any) -> None:
    """``value`` is True or False."""
    if not isinstance(value, bool):
        _fail(policy, name, "True or False", value)


#: pooling kernels of SnapKV-style scoring (``kvsim.policies._scoring.pool_scores``)
POOLINGS = ("avg", "max")
#: how the q-heads of a GQA group combine page bounds (Quest, ArkVale)
GROUP_REDUCES = ("max", "mean", "sum")
