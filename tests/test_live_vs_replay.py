"""Live decoding and the replay engine drive the same policy objects through the same protocol:
on a trace recorded by ``kvsim trace`` of the same clip, the prefill decisions agree, and at
decode step 0 layer 0 (the only query the compression has not yet touched) so does the
attention a policy sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvsim.live.decode import LiveConfig, live_generate
from kvsim.live.models import load_backbone
from kvsim.policies.base import HeadScores
from kvsim.tracer.audio import load_audio
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
from kvsim.trace.reader import Trace
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

torch.set_num_threads(1)
N_NEW = 8


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    ckpt = tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())
    d = tmp_path_factory.mktemp("lvr")
    wav = write_tone(d / "clip.wav", 6.0)
    res = CliRunner().invoke(app, ["trace", str(wav), "--model", str(ckpt), "--out", str(d / "t"),
                                   "--max-new-tokens", str(N_NEW), "--store-dtype", "float32",
                                   "--aligner", "none"])
    assert res.exit_code == 0, res.output
    trace = Trace(d / "t" / "clip.kvtrace")
    lm = load_backbone(str(ckpt))
    prompt = lm.prepare(load_audio(wav, lm.sample_rate).samples)
    lay = lm.layout
    rng = np.random.default_rng(0)
    scores = HeadScores(rng.random((lay.n_layers, lay.n_kv_heads)), rng.random((lay.n_layers, lay.n_kv_heads)))
    return trace, lm, prompt, scores


def test_same_prompt_layout(both):
    trace, lm, prompt, _ = both
    np.testing.assert_array_equal(trace.audio_positions, prompt.audio_positions)
    assert trace.meta.n_prefill == prompt.n_prompt


@pytest.mark.parametrize("name", ["snapkv", "adakv", "pyramidkv", "audiokv", "wnw", "voxzip", "h2o", "chunkkv"])
def test_prefill_tiers_agree(both, name):
    trace, lm, prompt, scores = both
    spec = PolicySpec(name, 0.3)
    rep = replay_trace(trace, [spec], ReplayConfig(record_tiers=True, head_scores=scores, max_steps=1))[0]
    live = live_generate(lm, prompt, spec, LiveConfig(N_NEW, head_scores=scores, record_tiers=True))
    np.testing.assert_array_equal(live.tiers_after_prefill, rep.tiers[0])


def test_step0_layer0_attention_agrees(both):
    trace, lm, prompt, scores = both
    seen = {}
    from kvsim.policies import registry

    base = registry.get("wnw")

    class Spy(base):
        def decode_step(self, view):
            seen.setdefault(self._tag, []).append(view.audio_attention(0).copy())
            return super().decode_step(view)

    make = PolicySpec.make
    try:
        def mk(self, tag):
            p = Spy(budget=self.budget)
            p._tag = tag
            return p
        PolicySpec.make = lambda self: mk(self, "replay")
        replay_trace(trace, [PolicySpec("wnw", 0.3)], ReplayConfig(head_scores=scores, max_steps=1))
        PolicySpec.make = lambda self: mk(self, "live")
        live_generate(lm, prompt, PolicySpec("wnw", 0.3), LiveConfig(2, head_scores=scores))
    finally:
        PolicySpec.make = make
    np.testing.assert_allclose(seen["live"][0], seen["replay"][0], atol=1e-6)
    assert (seen["live"][0] == 0).any()  # the policy really evicted something
