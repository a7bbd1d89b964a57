"""``kvsim policies``: list every policy with its paper and hyperparameters."""

from __future__ import annotations

import sys
import textwrap

from rich.console import Console
from rich.text import Text

from kvsim.commands._table import FormatOption, TableFormat


def policies(fmt: FormatOption = TableFormat.table) -> None:
    """List every registered policy: its paper, what kind it is, and each hyperparameter with its default on its own line (never cut; `-p name:key=value` overrides one)."""
    from kvsim.policies import registry

    rows = [(name, cls.paper, _kind(cls), cls.hyperparameters()) for name, cls in registry.available().items()]
    if fmt == TableFormat.csv:
        _write_csv(rows)
        return
    if fmt == TableFormat.markdown:
        lines = []
        for name, paper, kind, hp in rows:
            lines += [f"### {name}", "", f"{paper} ({kind})", ""]
            lines += [f"- `{key}` = `{value!r}`" for key, value in hp.items()] or ["- no hyperparameters"]
            lines.append("")
        sys.stdout.write("\n".join(lines))
        return
    console = Console(emoji=False, highlight=False)
    for name, paper, kind, hp in rows:
        console.print(Text.assemble((name, "bold"), f"  ({kind})"))
        for line in textwrap.wrap(paper, max(console.width - 2, 20), break_long_words=False):
            console.print(Text(f"  {line}"), soft_wrap=True)
        width = max((len(k) for k in hp), default=0)
        for key, value in hp.items():
            console.print(Text(f"    {key:<{width}} = {value!r}"), soft_wrap=True)
        if not hp:
            console.print(Text("    (no hyperparameters)"))
        console.print()


def _kind(cls: type) -> str:
    kind = ["recallable" if cls.recallable else "no recall"]
    if cls.query_aware:
        kind.append("query-aware")
    if not cls.saves_capacity:
        kind.append("bandwidth only")
    return ", ".join(kind)


def _write_csv(rows: list) -> None:
    """One line per (policy, hyperparameter); a policy without any has one line with empty fields."""
    import csv

    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(["policy", "paper", "kind", "hyperparameter", "default"])
    for name, paper, kind, hp in rows:
        for key, value in hp.items() or [("", "")]:
            writer.writerow([name, paper, kind, key, "" if key == "" else repr(value)])


COMMANDS = (policies,)
