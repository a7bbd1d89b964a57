"""The one way a command reports a user error: one plain line on stderr, then exit."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

#: stderr console shared by the commands for errors and progress lines (never read as markup).
err = Console(stderr=True, soft_wrap=True, emoji=False, highlight=False)


def print_error(message: str, label: str = "error:") -> None:
    """``label message`` as one line on stderr; ``message`` is plain text, never markup
    (control characters are escaped, so a hostile file name cannot break the line)."""
    from kvsim.trace.schema import one_line

    err.print(Text.assemble((label, "red"), " ", one_line(message)), soft_wrap=True)


def fail(message: str | BaseException, code: int = 2) -> NoReturn:
    """Print ``error: message`` as one line (see :func:`print_error`) and exit with ``code``.

    Exit code 2 means the command was called wrongly (bad option, missing input) and did no
    work; 1 means some of the work failed; 3 is reserved for a missing device.
    """
    text = str(message)
    print_error(text if text.strip() else type(message).__name__)
    raise typer.Exit(code)
