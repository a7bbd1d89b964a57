"""The package layout's import rules (docs/design.md, "Layout"), checked on the source.

Every ``import`` and ``from ... import`` of every module, module level and function level
alike, is read from its syntax tree; a rule broken anywhere fails with the offending lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (pyproject.toml [tool.setuptools.package-dir])
FOLDERS = {"kvsim": "kvsim", "policies": "kvsim.policies", "tracer": "kvsim.tracer",
           "live": "kvsim.live", "studies": "kvsim.studies", "minivox": "kvsim.minivox"}
#: the rooms whose dependencies the rules speak of
ROOMS = ("kvsim.core", "kvsim.policies", "kvsim.trace", "kvsim.replay", "kvsim.sim",
         "kvsim.tracer", "kvsim.live", "kvsim.studies", "kvsim.minivox", "kvsim.commands")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """Absolute names of every kvsim module imported by ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return [(name, line) for name, line in out if name == "kvsim" or name.startswith("kvsim.")]


def _room(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


@pytest.fixture(scope="module")
def edges() -> dict[str, list[tuple[str, str]]]:
    """room -> [(imported room, 'file:line'), ...] over every source file."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = _module_name(path)
            src = _room(module)
            for name, line in _imports(path, module):
                dst = _room(name)
                if src and dst and dst != src:
                    found[src].append((dst, f"{path.relative_to(ROOT)}:{line}"))
    return found


def test_every_source_folder_is_a_mapped_package() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    for folder, package in FOLDERS.items():
        assert f'"{package}" = "{folder}"' in text
        for init in (ROOT / folder).rglob("__init__.py"):
            sub = ".".join([package, *init.parent.relative_to(ROOT / folder).parts])
            assert f'"{sub}"' in text, f"{sub} is missing from [tool.setuptools] packages"


def test_core_depends_on_nothing_of_kvsim(edges) -> None:
    assert edges.get("kvsim.core", []) == []


def test_policies_import_only_the_core(edges) -> None:
    """The same policy object runs in replay and in live decoding and must not know which."""
    bad = [e for e in edges.get("kvsim.policies", []) if e[0] != "kvsim.core"]
    assert bad == []


def test_nothing_imports_the_replay_engine_for_shared_types(edges) -> None:
    """Only the commands and the studies run replays; the shared types live in the core."""
    allowed = {"kvsim.commands", "kvsim.studies"}
    bad = [(src, e) for src, es in edges.items() for e in es
           if e[0] == "kvsim.replay" and src not in allowed]
    assert bad == []


def test_no_cycles_between_rooms(edges) -> None:
    graph = {src: {dst for dst, _ in es} for src, es in edges.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
                where = [w for d, w in edges[node] if d == nxt][:3]
                pytest.fail(f"import cycle {' -> '.join(cycle)} (e.g. {where})")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for room in sorted(graph):
        if room not in state:
            visit(room, [room])


def test_every_source_folder_installs_as_a_listed_package():
    """A wheel holds only the packages pyproject.toml lists: every folder with Python modules
    must be a package (``__init__.py``) and be listed, or ``pip install .`` gives a kvsim whose
    imports fail (as ``kvsim.core`` once did, importing only from the source tree)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert config["package-dir"] == {pkg: folder for folder, pkg in FOLDERS.items()}
    folders = {p.parent for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
               if "__pycache__" not in p.parts}
    missing_init = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not missing_init, f"folders without __init__.py: {missing_init}"
    packages = {_module_name(f / "__init__.py") for f in folders}
    assert packages == listed, (f"not listed: {sorted(packages - listed)}; "
                                f"listed without a folder: {sorted(listed - packages)}")
