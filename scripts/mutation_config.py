"""Write one mutation target of ``[tool.kvsim.mutation]`` into a staging copy's ``[tool.mutmut]``.

Used by ``scripts/mutation_test.sh``: ``python scripts/mutation_config.py NAME PYPROJECT``.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path


def load_targets(pyproject: Path) -> dict[str, dict]:
    """Every mutation target of ``pyproject``: name -> ``source``, ``mutate``, ``tests``."""
    return tomllib.loads(pyproject.read_text())["tool"]["kvsim"]["mutation"]


def target_lines(pyproject: Path, name: str) -> str:
    """The ``source_paths``, ``only_mutate`` and test-selection lines of target ``name``."""
    targets = load_targets(pyproject)
    if name not in targets:
        raise SystemExit(f"{pyproject}: [tool.kvsim.mutation] has no target {name!r} "
                         f"(known: {', '.join(sorted(targets))})")
    t = targets[name]
    return (f"source_paths = {json.dumps([t['source']])}\n"
            f"only_mutate = {json.dumps(t['mutate'])}\n"
            f"pytest_add_cli_args_test_selection = {json.dumps(t['tests'])}\n")


def main(name: str, path: str) -> None:
    pyproject = Path(path)
    text = pyproject.read_text()
    header = "[tool.mutmut]\n"
    if header not in text:
        raise SystemExit(f"{pyproject}: no [tool.mutmut] section")
    pyproject.write_text(text.replace(header, header + target_lines(pyproject, name), 1))


if __name__ == "__main__":
    main(*sys.argv[1:])
