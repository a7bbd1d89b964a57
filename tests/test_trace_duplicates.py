"""A trace named twice (the same path, another spelling of it, a link to it, or a folder
holding it beside the trace itself) is refused before any work: it would count twice in
every mean. One line naming the path, exit 2, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.trace.reader import DuplicateTraceError, collect_traces, find_traces
from tests.conftest import make_trace

runner = CliRunner()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dups")
    make_trace(d / "tr" / "a.kvtrace", seed=1, steps=4)
    make_trace(d / "tr" / "b.kvtrace", seed=2, steps=4)
    os.symlink(d / "tr" / "a.kvtrace", d / "link.kvtrace")
    return d


def _spellings(folder: Path) -> dict[str, list[Path]]:
    a = folder / "tr" / "a.kvtrace"
    return {"same path": [a, a],
            "another spelling": [a, folder / "tr" / "." / "a.kvtrace"],
            "relative and absolute": [a, Path(os.path.relpath(a))],
            "a link": [a, folder / "link.kvtrace"],
            "its folder": [folder / "tr", a],
            "folder twice": [folder / "tr", folder / "tr" / ".."/ "tr"]}


@pytest.mark.parametrize("case", list(_spellings(Path("."))))
@pytest.mark.parametrize("collect", [find_traces, lambda a: collect_traces(a)[0]])
def test_reader_refuses_a_trace_named_twice(folder: Path, case: str, collect) -> None:
    args = _spellings(folder)[case]
    with pytest.raises(DuplicateTraceError) as info:
        collect(args)
    assert isinstance(info.value, ValueError)
    assert "given twice" in str(info.value) and "a.kvtrace" in str(info.value)


def test_distinct_traces_pass(folder: Path) -> None:
    assert [p.name for p in find_traces([folder / "tr"])] == ["a.kvtrace", "b.kvtrace"]
    paths, errors = collect_traces([folder / "tr" / "a.kvtrace", folder / "tr" / "b.kvtrace"])
    assert len(paths) == 2 and not errors


def _one_line(output: str, *needles: str) -> None:
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    assert all(n in lines[0] for n in needles), output


@pytest.mark.parametrize("command", [
    ["replay", "-p", "full"], ["info"], ["validate"], ["mismatch"], ["alignment"],
    ["study", "fig1", "--quick"]])
def test_commands_refuse_a_trace_given_twice(folder: Path, tmp_path: Path, command: list[str]) -> None:
    a = folder / "tr" / "a.kvtrace"
    out = tmp_path / "out"
    outs = ["-o", str(out)] if command[0] in ("replay", "study") else []
    res = runner.invoke(app, [*command, str(a), str(folder / "tr" / "." / "a.kvtrace"), *outs])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "a.kvtrace", "given twice")
    assert not out.exists()
