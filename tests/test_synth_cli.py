"""``kvsim synth`` under bad input: an existing target is never replaced without
``--overwrite``, an unusable target path and out-of-range options are one line (exit 2)
before any work, and nothing is written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.synth import MAX_AUDIO_SECONDS, MAX_DECODE_STEPS, SynthConfig, write_synthetic
from kvsim.trace import Trace
from kvsim.trace.writer import TraceWriter
from tests.conftest import make_trace

runner = CliRunner()
TINY = ["--preset", "tiny", "--audio-seconds", "2", "--decode-steps", "3"]


def _one_line(output: str, *needles: str) -> str:
    """The one error line of ``output``, holding every needle; no traceback."""
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1, output
    assert all(n in lines[0] for n in needles), (needles, output)
    return lines[0]


def _digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (what a destroyed or replaced trace changes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def recorded(tmp_path: Path) -> Path:
    """A trace standing in for a recorded one: minivox-shaped, unlike what TINY writes."""
    return make_trace(tmp_path / "rec.kvtrace", preset="small", seconds=3, steps=4, seed=7)


@pytest.mark.parametrize("spelling", ["rec.kvtrace", "rec"])  # the suffix is added when missing
def test_existing_trace_is_refused_and_kept(recorded: Path, spelling: str) -> None:
    before = _digest(recorded)
    res = runner.invoke(app, ["synth", str(recorded.parent / spelling), *TINY])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "error:", str(recorded), "already exists", "--overwrite")
    assert _digest(recorded) == before
    assert sorted(p.name for p in recorded.parent.iterdir()) == ["rec.kvtrace"]  # no leftovers


def test_overwrite_replaces_an_existing_trace(recorded: Path) -> None:
    res = runner.invoke(app, ["synth", str(recorded), *TINY, "--overwrite"])
    assert res.exit_code == 0, res.output
    assert Trace(recorded).meta.model.name == "tiny"
    assert sorted(p.name for p in recorded.parent.iterdir()) == ["rec.kvtrace"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_file_at_the_target_is_never_replaced(tmp_path: Path, overwrite: list[str]) -> None:
    target = tmp_path / "notes.kvtrace"
    target.write_text("my notes")
    res = runner.invoke(app, ["synth", str(target), *TINY, *overwrite])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "error:", str(target), "not a directory")
    assert target.read_text() == "my notes"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.kvtrace"]


def test_target_under_a_file_is_one_line_before_work(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "sub" / "x.kvtrace"
    res = runner.invoke(app, ["synth", str(target), *TINY])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "error:", str(target), f"{tmp_path / 'afile'} is not a directory")
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize(("args", "flag", "interval"), [
    (["--audio-seconds", "inf"], "--audio-seconds", f"(0, {MAX_AUDIO_SECONDS:g}]"),
    (["--audio-seconds", "nan"], "--audio-seconds", f"(0, {MAX_AUDIO_SECONDS:g}]"),
    (["--audio-seconds", "0"], "--audio-seconds", f"(0, {MAX_AUDIO_SECONDS:g}]"),
    (["--audio-seconds", "-3"], "--audio-seconds", f"(0, {MAX_AUDIO_SECONDS:g}]"),
    (["--audio-seconds", "100000"], "--audio-seconds", f"(0, {MAX_AUDIO_SECONDS:g}]"),
    (["--decode-steps", "0"], "--decode-steps", f"[1, {MAX_DECODE_STEPS:g}]"),
    (["--decode-steps", str(10**9)], "--decode-steps", f"[1, {MAX_DECODE_STEPS:g}]"),
    (["--seed", "-1"], "--seed", "[0, inf)"),
])
def test_option_out_of_range_is_one_line_naming_it(tmp_path: Path, args: list[str], flag: str,
                                                   interval: str) -> None:
    target = tmp_path / "x.kvtrace"
    res = runner.invoke(app, ["synth", str(target), "--preset", "voxtral-mini", *args])
    assert res.exit_code == 2, res.output
    _one_line(res.output, "error:", f"option {flag} must be in {interval}")
    assert list(tmp_path.iterdir()) == []


def test_library_write_refuses_an_existing_path_when_asked(recorded: Path) -> None:
    before = _digest(recorded)
    cfg = SynthConfig(preset="tiny", audio_seconds=2, decode_steps=3)
    with pytest.raises(FileExistsError):
        write_synthetic(recorded, cfg, overwrite=False)
    assert _digest(recorded) == before


def test_writer_never_replaces_a_directory_made_while_it_wrote(tmp_path: Path) -> None:
    """overwrite=False holds at the final rename too: a trace that appeared meanwhile stays."""
    from kvsim.synth import _Synthesizer

    cfg = SynthConfig(preset="tiny", audio_seconds=2, decode_steps=3)
    syn = _Synthesizer(cfg)
    target = tmp_path / "t.kvtrace"
    writer = TraceWriter(target, syn.model, syn.n_positions, syn.qpos, True, overwrite=False)
    with pytest.raises(FileExistsError), writer as w:  # noqa: PT012 -- the race is in the block
        for layer in range(syn.shape.n_layers):
            w.write_layer(layer, *syn.layer(layer))
        w.finish(*syn.finish())
        target.mkdir()
        (target / "mine.txt").write_text("someone else's")
    assert [p.name for p in target.iterdir()] == ["mine.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["t.kvtrace"]


def test_help_states_the_bounds_checked() -> None:
    res = runner.invoke(app, ["synth", "--help"], env={"COLUMNS": "250"})
    text = " ".join(res.output.split())
    assert f"in (0, {MAX_AUDIO_SECONDS:g}]" in text and f"in [1, {MAX_DECODE_STEPS}]" in text
    assert "--overwrite" in text
