"""WnW §2.1 figures measured from the speech onset, and their absence without word timings."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.studies.mismatch import mismatch
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace


def _trace(tmp_path: Path, *, onset_s: float | None) -> Trace:
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=8, decode_steps=6, seed=3))
    pos = data.positions
    if onset_s is None:
        pos = pos.with_columns(pl.lit(None, dtype=pl.Float64).alias("word_start_s"))
    else:  # move the first word to onset_s
        first = pos["word_start_s"].drop_nulls().min()
        pos = pos.with_columns(
            pl.when(pl.col("word_start_s") == first).then(pl.lit(onset_s))
            .otherwise(pl.col("word_start_s")).alias("word_start_s"))
    data.positions = pos
    name = "none" if onset_s is None else f"onset{onset_s}"
    return Trace(write_trace(tmp_path / f"{name}.kvtrace", data))


def test_speech_onset_shifts_the_first_10_percent(tmp_path: Path) -> None:
    late = mismatch(_trace(tmp_path, onset_s=2.0))
    # 2 s at 12.5 tokens/s: the onset is the 25th audio token
    assert late.speech_onset_index == 25
    assert 0.0 <= late.prefill_first10_speech <= 1.0
    # measuring from the onset drops the pre-speech sink, so the figure differs from the plain one
    assert late.prefill_first10_speech != late.prefill_first10


def test_no_word_timings_gives_nan_not_a_copy(tmp_path: Path) -> None:
    s = mismatch(_trace(tmp_path, onset_s=None))
    assert s.speech_onset_index == -1
    assert math.isnan(s.prefill_first10_speech) and math.isnan(s.decode_first10_speech)
    assert not math.isnan(s.prefill_first10)


def test_cli_prints_speech_rows_and_na(tmp_path: Path) -> None:
    t = _trace(tmp_path, onset_s=None)
    res = CliRunner().invoke(app, ["mismatch", str(t.path)], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "first 10% of speech" in res.output and "n/a" in res.output
    assert "not reported" in res.output  # the paper has no onset figure
