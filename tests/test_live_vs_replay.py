"""Live decoding and the replay engine drive the same policy objects through the same protocol:
on a trace recorded by ``kvsim trace`` of the same clip, the prefill decisions agree, and at
decode step 0 layer 0 (the only query the compression has not yet touched) so does the
attention a policy sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.live.decode import LiveConfig, live_generate
from kvsim.live.models import load_backbone
from kvsim.policies.base import HeadScores
from kvsim.replay.engine import PolicySpec, ReplayConfig, replay_trace
from kvsim.trace.reader import Trace
from kvsim.tracer.audio import load_audio
from tests.fixtures.checkpoints import tiny_checkpoint, write_tone
from tests.float32_bounds import logit_bound, renormalised_rel_bound, softmax_rel_bound

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
    # the same float32 queries and keys (layer 0 depends on the prompt and token alone):
    # live softmaxes over the kept keys in torch, replay renormalises its full softmax in numpy;
    # each within its worst-case float32 error of the float64 softmax over the kept keys
    live, rep = seen["live"][0], seen["replay"][0]
    exact, tol = _exact_kept_attention(trace, rep != 0)
    assert (tol <= 1e-3 * exact).all()  # tight against a wrong mask or a missed renormaliser
    np.testing.assert_array_less(np.abs(live - rep), tol + 1e-30)
    assert (seen["live"][0] == 0).any()  # the policy really evicted something


def _exact_kept_attention(trace: Trace, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float64 audio attention (H_q, T_a) of layer 0 at decode step 0 over the non-audio and
    the ``kept`` audio keys, and the bound on |live − replay|: the sum of the float32 error
    bounds of the replay engine (renormalised full softmax) and of a direct masked softmax."""
    m = trace.meta
    g = m.model.n_q_heads // m.model.n_kv_heads
    p = m.n_prefill
    q = np.asarray(trace.queries(0)[:, trace.query_index(p)], dtype=np.float64)
    k = np.asarray(trace.keys(0)[:, : p + 1], dtype=np.float64)
    audio = trace.audio_positions
    exact, tol = np.zeros(kept.shape), np.zeros(kept.shape)
    for h in range(m.model.n_q_heads):
        allowed = np.ones(p + 1, dtype=bool)
        allowed[audio] = kept[h]
        logits = k[h // g] @ q[h] / np.sqrt(m.model.head_dim)
        w = np.exp(logits - logits.max())
        z = (w / w.sum())[allowed].sum()
        exact[h] = np.where(allowed, w, 0.0)[audio] / w[allowed].sum()
        err = logit_bound(q[h], k[h // g])
        rel_live = softmax_rel_bound(np.where(allowed, err, 0.0), int(allowed.sum()))
        rel_replay = renormalised_rel_bound(err, allowed, z, len(audio))
        tol[h] = exact[h] * (rel_live + rel_replay)
    return exact, tol


def test_voxzip_generation_scope_evicts_alike_live_and_in_replay(both):
    """VoxZip's generation scope in both drivers: the same prefill tiers and, at every decode
    step, one audio token evicted per (layer, KV-head), i.e. the same GPU audio count and the
    same releases (which tokens go may differ: live attention comes from the compressed model,
    replay's from the recorded full-model queries)."""
    trace, lm, prompt, scores = both
    spec = PolicySpec("voxzip", 0.3)
    rep = replay_trace(trace, [spec], ReplayConfig(record_tiers=True))[0]
    live = live_generate(lm, prompt, spec, LiveConfig(N_NEW, record_tiers=True))
    np.testing.assert_array_equal(live.tiers_after_prefill, rep.tiers[0])
    n = min(live.step_log.height, rep.step_log.height)
    assert n >= 3
    cols = ["step", "gpu_audio_tokens", "released_tokens"]
    assert live.step_log[cols].head(n).equals(rep.step_log[cols].head(n))
    heads = lm.layout.n_layers * lm.layout.n_kv_heads
    assert (live.step_log["released_tokens"].head(n) == heads).all()
