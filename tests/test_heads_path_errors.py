"""A folder (or a missing file) where a heads.json or a word alignment is expected: every
command that reads one says so in one line naming the path, exit 2, before any model loads
and without writing results."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.trace.heads import read_heads
from kvsim.trace.schema import TraceError
from kvsim.tracer.alignment import AlignmentError, load_word_times
from tests.conftest import make_trace
from tests.fixtures.checkpoints import write_tone

runner = CliRunner()


def _error_line(output: str, *needles: str) -> str:
    """The one ``error:`` line, holding every needle; no traceback."""
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, output
    assert all(n in lines[0] for n in needles), output
    return lines[0]


def test_read_heads_of_a_folder_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="is a directory, not a regular file") as info:
        read_heads(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_word_times_of_a_folder_is_an_alignment_error(tmp_path: Path) -> None:
    with pytest.raises(AlignmentError, match=f"{tmp_path}: is a directory"):
        load_word_times(tmp_path)


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return make_trace(tmp_path_factory.mktemp("t") / "a.kvtrace", preset="minivox", seconds=4, steps=4)


def _commands(tmp_path: Path, trace: Path, folder: Path) -> dict[str, list[str]]:
    wav = str(write_tone(tmp_path / "a.wav", 1.0))
    out = ["-o", str(tmp_path / "out")]
    return {
        "replay": ["replay", str(trace), "-p", "wnw", "--calibration", str(folder), *out],
        "trace": ["trace", wav, "--model", "minivox", "--heads", str(folder), *out],
        "live": ["live", wav, "--model", "tiny", "--calibration", str(folder), *out],
        "study table3": ["study", "table3", str(trace), "--calibration", str(folder), *out],
        "alignment": ["alignment", str(trace), "--words", str(folder)],
    }


@pytest.mark.parametrize("command", ["replay", "trace", "live", "study table3", "alignment"])
def test_a_folder_given_as_a_heads_file_is_one_line(command: str, tmp_path: Path, trace: Path) -> None:
    folder = tmp_path / "calib"
    folder.mkdir()
    res = runner.invoke(app, _commands(tmp_path, trace, folder)[command])
    assert res.exit_code == (1 if command == "alignment" else 2), res.output
    _error_line(res.output, str(folder), "is a directory")
    assert "kvsim bug" not in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["replay", "trace", "live"])
def test_a_missing_heads_file_is_one_line(command: str, tmp_path: Path, trace: Path) -> None:
    missing = tmp_path / "nonexistent.json"
    res = runner.invoke(app, _commands(tmp_path, trace, missing)[command])
    assert res.exit_code == 2, res.output
    _error_line(res.output, str(missing))
    assert not (tmp_path / "out").exists()
