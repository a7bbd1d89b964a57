"""``kvsim policies``: list every policy with its paper and hyperparameters."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table


def policies() -> None:
    """List every registered policy, its paper, and its hyperparameters with defaults."""
    from kvsim.policies import registry

    table = Table(title="kvsim policies", show_lines=True)
    table.add_column("name", style="bold")
    table.add_column("paper")
    table.add_column("hyperparameters (defaults)")
    table.add_column("kind")
    for name, cls in registry.available().items():
        hp = ", ".join(f"{k}={v!r}" for k, v in cls.hyperparameters().items()) or "-"
        kind = []
        kind.append("recallable" if cls.recallable else "no recall")
        if cls.query_aware:
            kind.append("query-aware")
        if not cls.saves_capacity:
            kind.append("bandwidth only")
        table.add_row(name, cls.paper, hp, ", ".join(kind))
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command(name="policies")(policies)
