"""The alignment-path study (studies/alignment.py, ``kvsim alignment``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.studies.alignment import (
    chance_agreement,
    find_jumps,
    median_filter,
    monotonicity,
    word_agreement,
)
from kvsim.tracer.alignment import WordTiming

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "traces" / "minivox-test_30_60-00013.kvtrace"
WORDS = ROOT / "tests" / "fixtures" / "minivox-test_30_60-00013.words.json"


def test_monotonicity_ranks_a_moving_peak_above_a_sink_and_a_reversed_path():
    n, t = 40, 100
    dist = np.zeros((3, n, t))
    dist[0, np.arange(n), np.arange(n) * 2] = 1  # reads forward
    dist[1, :, 7] = 1  # an attention sink: never moves
    dist[2, np.arange(n), 99 - np.arange(n) * 2] = 1  # reads backward
    mono = monotonicity(dist)
    assert mono[0] == pytest.approx(1.0) and mono[1] == 0.0 and mono[2] == pytest.approx(-1.0)


def test_median_filter_drops_isolated_outliers_and_jumps_keep_real_ones():
    path = np.array([1, 2, 3, 50, 4, 5, 6, 7, 30, 31, 32, 33, 34, 10, 11, 12, 13], float)
    smooth = median_filter(path, 3)
    assert smooth[3] == 4  # one-token excursion (punctuation looking elsewhere) removed
    jumps = find_jumps(smooth, 5.0)
    assert [(j.step, j.seconds > 0) for j in jumps] == [(8, True), (13, False)]
    assert jumps[0].from_s == 7 and jumps[0].to_s == 30


def test_word_agreement_counts_words_written_at_their_audio():
    ref = [WordTiming(w, float(i), float(i) + 0.8) for i, w in enumerate(["the", "cat", "sat", "on", "a", "mat"])]
    # one row per token; "cat" spans two tokens, counted once; the last word is read at the wrong place
    path = pl.DataFrame({"word": ["The", "cat", "cat", "sat", "on", "a", "mat."],
                         "peak_s": [0.1, 1.2, 1.5, 2.3, 3.1, 4.2, 0.2]})
    assert word_agreement(path, ref, tolerance=0) == pytest.approx(5 / 6)
    assert word_agreement(path, ref, tolerance=1) == pytest.approx(5 / 6)  # "mat" is 5 words away
    assert chance_agreement(path, ref, tolerance=0) < 0.5


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="shipped minivox trace not present")
def test_shipped_minivox_trace_reads_its_audio_in_order(tmp_path):
    """On the shipped real trace (a 59 s clip the model transcribes, WER 0.24) the path read from
    the most monotonic layers moves forward through the speech and the model writes the word
    spoken where it looks far above chance; a random or synthetic trace would not."""
    res = CliRunner().invoke(app, ["alignment", str(SHIPPED), "--words", str(WORDS), "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    from kvsim.studies.alignment import alignment
    from kvsim.trace.reader import Trace

    trace = Trace(SHIPPED)
    path = pl.read_parquet(tmp_path / "minivox-test_30_60-00013.alignment.parquet")
    generated = trace.positions.filter(pl.col("kind") == "generated")
    assert path["position"].to_list() == generated["position"].to_list()  # one row per written token
    a = alignment(trace)
    assert min(a.layer_monotonicity) > 0.9
    assert len(a.jumps) <= 3
    assert a.covered_seconds() > 50
    from kvsim.tracer.alignment import load_word_times

    ref = load_word_times(WORDS)
    assert word_agreement(a.path, ref) > 0.5 > 0.1 > chance_agreement(a.path, ref)


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="shipped minivox trace not present")
@pytest.mark.parametrize("content, why", [(None, "not found"), ('{"words": [1]}', "words[0]: needs word")])
def test_a_bad_words_file_is_one_line_naming_it_once(tmp_path, content, why):
    words = tmp_path / "w.json"
    if content is not None:
        words.write_text(content)
    res = CliRunner().invoke(app, ["alignment", str(SHIPPED), "--words", str(words), "-o", str(tmp_path)])
    assert res.exit_code != 0
    line = next(ln for ln in res.output.splitlines() if ln.startswith("error:"))
    assert why in line and line.count(str(words)) == 1


def test_word_match_says_why_it_is_missing_instead_of_nan():
    """A trace made with --aligner none names no written words: the cell says so (was "nan%")."""
    from kvsim.commands.alignment import agreement_text

    ref = [WordTiming(w, float(i), float(i) + 0.5) for i, w in enumerate(["the", "cat", "sat", "on", "a", "mat"])]
    words = ["the", "cat", "sat"]
    path = pl.DataFrame({"word": words, "peak_s": [0.1, 1.1, 2.1]})
    assert agreement_text(path, None) == "n/a"
    assert agreement_text(path, ref).startswith("100% (chance ")
    no_words = path.with_columns(pl.lit(None, dtype=pl.String).alias("word"))
    assert agreement_text(no_words, ref) == "n/a (no words in the trace: traced with --aligner none)"
    blank = path.with_columns(pl.lit("...").alias("word"))
    assert agreement_text(blank, ref) == "n/a (no written words)"
