"""Comma-separated values of a command-line option (``--read-window 2,3,8``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def parse_comma_option(build: Callable[..., T], spec: str, option: str, usage: str,
                       types: tuple[Callable[[str], object], ...]) -> T:
    """``build(*values)``: ``spec`` split at commas, each part converted by the type at its place.

    ValueError naming ``option`` and the value, with ``usage`` (e.g. ``"BEHIND,AHEAD,STALL
    (e.g. 2,3,8)"``) when the count is wrong, or with the conversion's or ``build``'s message.
    """
    parts = spec.split(",")
    if len(parts) != len(types):
        raise ValueError(f"{option} {spec!r}: {usage}")
    try:
        return build(*(convert(part) for convert, part in zip(types, parts, strict=True)))
    except ValueError as exc:
        raise ValueError(f"{option} {spec!r}: {exc}") from None
