"""The ``kvsim`` command line. Sub-commands live in :mod:`kvsim.commands`, one module each."""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

# One intra-op thread before numpy/torch load their thread pools (see set_single_thread).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import typer  # noqa: E402

app = typer.Typer(
    name="kvsim",
    help="Record, replay, simulate and validate KV-cache policies for long-form speech LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_commands() -> None:
    """Register every function listed in a command module's ``COMMANDS`` under its name
    (underscores become dashes: ``calibrate_hw`` is ``kvsim calibrate-hw``)."""
    import kvsim.commands as pkg

    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvsim.commands.{mod.name}")
        for command in module.COMMANDS:
            if isinstance(command, typer.Typer):  # a command group (``kvsim study ...``)
                app.add_typer(command)
            else:
                app.command(name=command.__name__.replace("_", "-"))(command)


def set_single_thread() -> None:
    """One intra-op thread: measured ~20x faster than 2 OpenMP threads for small decode
    steps on the development CPUs. Respect an explicit user setting."""
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_register_commands()


def one_line_warnings() -> None:
    """Warnings (e.g. WnW's per-input λ) as one ``warning: message`` line on stderr, not
    Python's two-line ``file:line: Category: message`` plus source line."""
    import warnings

    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"


def main() -> None:
    set_single_thread()
    one_line_warnings()
    app()


if __name__ == "__main__":
    main()
