"""The mutation-testing targets of scripts/mutation_test.sh ([tool.kvsim.mutation] in
pyproject.toml) name files that exist, and the staging copy gets a valid [tool.mutmut]."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the staging copy moves policies/ to kvsim/policies/ (scripts/mutation_test.sh); the rest
#: of the tree keeps its place
STAGED = {"kvsim/policies/": "policies/"}


def _config():
    spec = importlib.util.spec_from_file_location("mutation_config", ROOT / "scripts/mutation_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in_checkout(path: str) -> str:
    for staged, here in STAGED.items():
        if path.startswith(staged):
            return here + path[len(staged):]
    return path


TARGETS = _config().load_targets(ROOT / "pyproject.toml")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_target_names_existing_sources_and_tests(name) -> None:
    target = TARGETS[name]
    assert (ROOT / _in_checkout(target["source"])).is_dir()
    for pattern in target["mutate"]:
        assert pattern.startswith(target["source"]), pattern  # mutmut mutates under source_paths
        assert list(ROOT.glob(_in_checkout(pattern))), pattern
    for test in target["tests"]:
        assert (ROOT / test).is_file(), test


def test_the_staging_pyproject_gets_the_targets_settings(tmp_path) -> None:
    staged = tmp_path / "pyproject.toml"
    staged.write_text((ROOT / "pyproject.toml").read_text())
    _config().main("voxzip", str(staged))
    mutmut = tomllib.loads(staged.read_text())["tool"]["mutmut"]
    assert mutmut["only_mutate"] == ["kvsim/policies/voxzip.py"]
    assert mutmut["source_paths"] == ["kvsim/policies/"]
    assert mutmut["pytest_add_cli_args_test_selection"] == TARGETS["voxzip"]["tests"]
    assert mutmut["process_isolation"] == "forkserver"  # polars deadlocks in a plain fork


def test_an_unknown_target_is_a_one_line_error(tmp_path) -> None:
    staged = tmp_path / "pyproject.toml"
    staged.write_text((ROOT / "pyproject.toml").read_text())
    known = ", ".join(sorted(TARGETS))
    with pytest.raises(SystemExit, match=rf"has no target 'nope' \(known: {known}\)"):
        _config().main("nope", str(staged))
