"""Traces written before the observation window and padding were fixed still read as they
were: their window is what they stored, their padding is unknown (reader and ``kvsim info``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace
from kvsim.trace.schema import observation_window
from kvsim.tracer.backbones.base import Backbone

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "traces" / "minivox-test_30_60-00013.kvtrace"


def test_observation_window_is_the_last_prompt_positions():
    assert list(observation_window(100)) == list(range(68, 100))
    assert list(observation_window(10)) == list(range(10))  # short prompt: all of it
    with pytest.raises(ValueError, match="window"):
        observation_window(10, 0)


def test_synth_window_defaults_to_32_and_reaches_into_the_audio(tmp_path: Path):
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=4, decode_steps=3))
    t = Trace(write_trace(tmp_path / "w.kvtrace", data))
    n0 = t.meta.n_prefill
    np.testing.assert_array_equal(t.window_positions, np.arange(n0 - 32, n0))
    # 12 text positions follow the audio, so the other 20 window positions are audio
    assert np.isin(t.window_positions, t.audio_positions).sum() == 20


def test_a_trace_that_stored_the_text_after_the_audio_keeps_that_window(tmp_path: Path):
    """The layout of traces recorded before the fix: queries after the audio only."""
    data = synthesize(SynthConfig(preset="tiny", audio_seconds=4, decode_steps=3,
                                  observation_window=12))  # = the 12 text positions
    t = Trace(write_trace(tmp_path / "old.kvtrace", data))
    np.testing.assert_array_equal(t.window_positions,
                                  np.arange(t.audio_positions[-1] + 1, t.meta.n_prefill))
    assert not t.padding_recorded and len(t.padding_positions) == 0


@pytest.mark.skipif(not SHIPPED.exists(), reason="shipped trace not in this checkout")
def test_shipped_trace_has_the_32_window_and_its_padding():
    """The shipped minivox trace is recorded with WnW App. F's 32-query window (13 text
    positions follow the audio, so 19 window queries are audio) and marks its padding: the
    59.57 s clip is padded to 60 s, the last 5 tokens (start >= 59.57 s at 12.5 tokens/s)."""
    t = Trace(SHIPPED)
    n0 = t.meta.n_prefill
    np.testing.assert_array_equal(t.window_positions, np.arange(n0 - 32, n0))
    assert np.isin(t.window_positions, t.audio_positions).sum() == 19
    assert t.padding_recorded
    np.testing.assert_array_equal(t.padding_positions, t.audio_positions[-5:])
    out = CliRunner().invoke(app, ["info", str(SHIPPED)], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "32 prompt queries (19 audio)" in out.output and "5 tokens" in out.output


def test_padding_rule_is_tokens_starting_at_or_after_the_end():
    start = np.arange(375) / 12.5  # one 30 s window at 12.5 tokens/s
    pad = Backbone.padding_beyond(start, 3.3)
    assert pad.sum() == 375 - 42 and not pad[41] and pad[42]  # 41 x 0.08 = 3.28 s < 3.3 s
    assert not Backbone.padding_beyond(start, 30.0).any()
