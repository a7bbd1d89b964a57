"""Synthetic traces have the attention structure of WnW §2.1, from real q/k."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsim.core.attention import causal_attention
from kvsim.studies.mismatch import mismatch
from kvsim.synth import SynthConfig, synthesize
from kvsim.trace import Trace, write_trace


@pytest.fixture(scope="module")
def minivox_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    d = tmp_path_factory.mktemp("synth")
    return Trace(write_trace(d / "m.kvtrace", synthesize(SynthConfig(preset="minivox", audio_seconds=60,
                                                                      decode_steps=100, seed=0))))


def test_prefill_sink_and_decode_spread(minivox_trace: Trace) -> None:
    s = mismatch(minivox_trace)
    # prefill concentrates near the audio start (paper: 47.9% in the first 10%)
    assert 0.35 < s.prefill_first10 < 0.65
    # decode-cumulative is close to uniform (paper: 9.8% in the first 10%, 47.7% first half)
    assert 0.05 < s.decode_first10 < 0.18
    assert 0.40 < s.decode_first_half < 0.60
    # top-K rankings overlap weakly but above chance (paper: 0.187 at K=100)
    assert s.random_jaccard_top100 < s.jaccard_top100 < 0.4
    assert s.head_jaccard_min < s.head_jaccard_max


def test_frontier_sweeps_through_audio(minivox_trace: Trace) -> None:
    """The argmax of the averaged decode attention moves forward through the audio."""
    t = minivox_trace
    m = t.meta
    layer = 3
    pos = np.arange(m.n_prefill, m.n_positions)
    rows = [t.query_index(int(p)) for p in pos]
    att = causal_attention(t.queries(layer)[:, rows].astype(np.float32),
                           t.keys(layer).astype(np.float32), pos)[:, :, t.audio_positions]
    centre = (att.mean(0) * np.arange(t.n_audio)).sum(-1) / att.mean(0).sum(-1)
    first, last = centre[: len(centre) // 4].mean(), centre[-len(centre) // 4:].mean()
    assert last - first > 0.3 * t.n_audio
    assert np.corrcoef(np.arange(len(centre)), centre)[0, 1] > 0.8


def test_heads_differ_and_scores_follow_roles(minivox_trace: Trace) -> None:
    roles = minivox_trace.meta.provenance["roles"]
    assert all(roles[r] > 0 for r in ("frontier", "diffuse", "sink"))
    hs = minivox_trace.head_scores
    assert hs.voice_score.shape == (30, 3)
    assert hs.voice_score.std() > 0.05


@pytest.mark.parametrize("preset", ["voxtral-mini", "qwen-omni", "minivox", "small", "tiny"])
def test_presets_have_backbone_shapes(tmp_path: Path, preset: str) -> None:
    d = synthesize(SynthConfig(preset=preset, audio_seconds=2, decode_steps=2, store_values=False))
    from kvsim.shapes import get_shape

    s = get_shape(preset)
    assert d.keys.shape[:2] == (s.n_layers, s.n_kv_heads)
    assert d.queries.shape[:2] == (s.n_layers, s.n_q_heads)
    assert d.keys.shape[-1] == s.head_dim
    assert (d.positions["kind"] == "audio").sum() == round(2 * s.audio_tokens_per_s)
