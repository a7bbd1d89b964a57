"""CLI sub-commands. Each module defines ``register(app: typer.Typer)``; :mod:`kvsim.cli`
discovers them, so a new command is a new file."""
