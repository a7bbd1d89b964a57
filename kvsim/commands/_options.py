"""Shared by the commands: help texts and the one range check of numeric options."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

MODEL_HELP = "voxtral-mini, voxtral-small, qwen-omni, minivox, or a checkpoint directory."


class OptionError(ValueError):
    """A command-line option outside its valid range; ``str()`` is the one-line message."""


def check_range(flag: str, value: float | None, low: float | None = None,
                high: float | None = None, *, low_open: bool = False,
                high_open: bool = False) -> None:
    """Raise :class:`OptionError` ``"option FLAG must be in RANGE, got V"`` unless ``value``
    lies in the interval (``None`` = option not given, always accepted; NaN never is).

    Parameters
    ----------
    flag : the option as the user types it, e.g. ``--topk``
    low, high : bounds (None = unbounded); ``low_open`` / ``high_open`` exclude them.
    """
    if value is None:
        return
    lo_ok = low is None or (value > low if low_open else value >= low)
    hi_ok = high is None or (value < high if high_open else value <= high)
    if math.isnan(value) or not (lo_ok and hi_ok):
        raise OptionError(f"option {flag} must be in {_interval(low, high, low_open, high_open)}, "
                          f"got {value if isinstance(value, int) else f'{value:g}'}")


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    left = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
    right = "inf)" if high is None else f"{high:g}{')' if high_open else ']'}"
    return f"{left}, {right}"


def check_positive_ints(**options: int | None) -> None:
    """``check_range(--name, v, 1)`` for each keyword (underscores become dashes)."""
    for name, value in options.items():
        check_range("--" + name.replace("_", "-"), value, 1)


def calibration_for(model: str, given: Path | None) -> Path | None:
    """The heads.json a command reads: ``given``, else for ``--model minivox`` with the
    shipped adapter its own (:data:`kvsim.minivox.SHIPPED_HEADS`), else None (policies that
    need head scores then say how to make them). Another adapter (``$MINIVOX_ADAPTER``)
    gets no default: the shipped scores were calibrated on the shipped adapter."""
    if given is not None or model != "minivox":
        return given
    from kvsim.minivox import SHIPPED_HEADS
    from kvsim.minivox.build import REPO_WEIGHTS, default_adapter_path

    adapter = default_adapter_path()
    if adapter is None or adapter.resolve() != REPO_WEIGHTS:
        return None
    return SHIPPED_HEADS


def announce_shipped_calibration(path: Path, flag: str, alternatives: str = "") -> None:
    """Say on stderr that ``path`` came from :func:`calibration_for`'s minivox default."""
    from kvsim.commands._errors import err

    err.print(f"head scores: {path} (minivox's shipped calibration; {flag} FILE for another"
              f"{alternatives})", markup=False)


ReadWindowOption = Annotated[str | None, typer.Option(
    "--read-window", metavar="BEHIND,AHEAD,STALL",
    help="Decoding option, not the papers' protocol: the aligning layers (minivox's 20-23) read only "
         "the audio from BEHIND s before to AHEAD s after a forward-only read position, pushed one "
         "audio token after STALL tokens without a move (e.g. 2,3,8)")]
BanCyclesOption = Annotated[str | None, typer.Option(
    "--ban-cycles", metavar="MAX_PERIOD,REPEATS",
    help="Decoding option, not the papers' protocol: the token that would start copy REPEATS+1 in a "
         "row of a cycle of at most MAX_PERIOD tokens is banned (e.g. 16,3)")]


HoldEndOption = Annotated[float | None, typer.Option(
    "--hold-end", metavar="SECONDS",
    help="Decoding option, not the papers' protocol, with --read-window: no end of answer while the "
         "read position is more than SECONDS before the end of the speech (e.g. 3)")]


def parse_decoding_options(read_window: str | None, ban_cycles: str | None,
                           hold_end: float | None = None) -> dict[str, Any]:
    """``LiveConfig`` keyword arguments of ``--read-window`` / ``--ban-cycles`` / ``--hold-end``
    (ValueError on a bad value, naming the option)."""
    from kvsim.decoding.cycle_ban import CycleBanConfig
    from kvsim.decoding.hold_end import check_hold_end
    from kvsim.decoding.read_window import ReadWindowConfig

    options = {"read_window": ReadWindowConfig.parse(read_window) if read_window else None,
               "ban_cycles": CycleBanConfig.parse(ban_cycles) if ban_cycles else None,
               "hold_end": hold_end}
    check_hold_end(hold_end, options["read_window"])
    return options
