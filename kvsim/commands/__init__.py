"""CLI sub-commands, one module each. A module lists its command functions (module-level,
typer-annotated) in ``COMMANDS``; :mod:`kvsim.cli` registers them under their names, so a new
command is a new file. User errors go through :func:`kvsim.commands._errors.fail` and tables
through :func:`kvsim.commands._table.print_frame`."""
