"""Configuration dataclasses whose fields are also command-line options.

A field made with :func:`option` carries its help text, so the dataclass is the one definition
of each option: :func:`add_options` adds ``--field-name`` to a parser for every field, with the
field's default, type and help.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, field, fields
from typing import Any


def option(default: Any, help: str, type: Callable[[str], Any] | None = None,
           choices: Sequence[str] | None = None) -> Any:
    """A dataclass field with its command-line ``help`` (and ``type`` where the default is None)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


def add_options(ap: argparse.ArgumentParser, config: type) -> None:
    """Add ``--name`` to ``ap`` for every field of the dataclass ``config``: booleans as
    ``--name/--no-name``, the rest typed by ``metadata["type"]`` or their default's type."""
    for f in fields(config):
        if f.default is MISSING or "help" not in f.metadata:
            raise TypeError(f"{config.__name__}.{f.name}: declare it with option(default, help)")
        flag, v, meta = f"--{f.name.replace('_', '-')}", f.default, f.metadata
        if isinstance(v, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=v,
                            help=meta["help"])
        else:
            ap.add_argument(flag, type=meta["type"] or type(v), default=v,
                            choices=meta["choices"], help=f"{meta['help']} (default: {v})")
