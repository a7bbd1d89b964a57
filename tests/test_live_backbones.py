"""Live decoding on tiny random-weight Voxtral and Qwen2.5-Omni thinker checkpoints, driven
through their real processors and chat templates (kvsim.tracer.backbones)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsim.live.decode import LiveConfig, live_generate, plain_generate
from kvsim.live.models import load_backbone
from kvsim.policies import registry
from kvsim.policies.base import HeadScores
from kvsim.replay.engine import PolicySpec
from tests.fixtures.checkpoints import tiny_checkpoint

torch.set_num_threads(1)
N_NEW = 16


@pytest.fixture(scope="module", params=["voxtral", "qwen-omni"])
def setup(request, tmp_path_factory):
    lm = load_backbone(str(tiny_checkpoint(request.param, tmp_path_factory.getbasetemp())))
    rng = np.random.default_rng(0)
    prompt = lm.prepare((0.1 * rng.standard_normal(16000 * 8)).astype(np.float32))
    lay = lm.layout
    scores = HeadScores(rng.random((lay.n_layers, lay.n_kv_heads)),
                        rng.random((lay.n_layers, lay.n_kv_heads)))
    return lm, prompt, scores, plain_generate(lm, prompt, N_NEW)


def test_audio_span_from_the_processor(setup):
    lm, prompt, _, _ = setup
    ids = prompt.model_inputs["input_ids"][0].numpy()
    assert (ids[prompt.audio_positions] == lm.bb.audio_token_id).all()
    assert (np.diff(prompt.audio_positions) == 1).all()


def test_every_policy_at_budget_one_matches_generate(setup):
    lm, prompt, scores, ref = setup
    for name in registry.available():
        # VoxZip's generation scope evicts even at r = 1 (its budget holds the generated
        # tokens); its audio-only scope keeps everything at r = 1
        params = {"scope": "audio"} if name == "voxzip" else {}
        run = live_generate(lm, prompt, PolicySpec(name, 1.0, params), LiveConfig(N_NEW, head_scores=scores))
        assert run.tokens == ref, name


@pytest.mark.parametrize(("name", "budget"), [("full", 1.0), ("wnw", 0.3), ("arkvale", 0.3)])
def test_physical_matches_masking(setup, name, budget):
    lm, prompt, scores, ref = setup
    runs = [live_generate(lm, prompt, PolicySpec(name, budget), LiveConfig(N_NEW, physical=p, head_scores=scores))
            for p in (False, True)]
    assert runs[0].tokens == runs[1].tokens
    if name == "full":
        assert runs[0].tokens == ref
    else:
        assert runs[1].summary["r_gpu"] < 0.5


def test_identity_transform_reproduces_the_untransformed_run(setup):
    """AffPool at retention 1 rewrites nothing: the prefill from inputs_embeds (the transform
    path) must then give exactly the tokens of the processor's input_ids + input_features."""
    from kvsim.tracer.transforms import parse_transforms

    lm, prompt, scores, ref = setup
    if lm.family != "voxtral":
        with pytest.raises(ValueError, match="Voxtral-family"):
            lm.embed(prompt)
        return
    p2 = parse_transforms("affpool:1")["affpool:1"](lm, prompt, None)
    assert p2.inputs_embeds is not None and p2.n_audio == prompt.n_audio
    run = live_generate(lm, p2, PolicySpec("full", 1.0), LiveConfig(N_NEW, head_scores=scores))
    assert run.tokens == ref
    p3 = parse_transforms("affpool:0.5")["affpool:0.5"](lm, prompt, None)
    assert abs(p3.n_audio / prompt.n_audio - 0.5) <= 0.02
    live_generate(lm, p3, PolicySpec("wnw", 0.3), LiveConfig(4, head_scores=scores, physical=True))


def test_translate_task_changes_the_prompt(setup):
    lm, prompt, _, _ = setup
    rng = np.random.default_rng(0)
    tr = lm.prepare((0.1 * rng.standard_normal(16000 * 8)).astype(np.float32), task="translate", language="fr")
    assert tr.n_audio == prompt.n_audio
    a, b = prompt.model_inputs["input_ids"][0].tolist(), tr.model_inputs["input_ids"][0].tolist()
    assert a != b


def test_nopad_takes_the_encoder_padding_out_of_the_input(setup):
    """``--transform nopad``: the decoder's input loses exactly the audio tokens the processor
    marked as padding (Voxtral pads 8 s to a 30 s window; Qwen2.5-Omni has none), the speech
    tokens and the text keep their embeddings bit for bit, and the result decodes live."""
    from kvsim.tracer.transforms import parse_transforms

    lm, prompt, scores, _ = setup
    pad = prompt.audio_padding
    assert pad is not None and len(pad) == prompt.n_audio
    if lm.family != "voxtral":
        assert not pad.any()  # placeholders cover the input's frames only
        return
    n_real = int((~pad).sum())
    assert 0 < n_real < prompt.n_audio
    assert not pad[:n_real].any() and pad[n_real:].all()  # the tail of the last window
    assert (prompt.audio_start_s[pad] >= prompt.duration_s).all()
    p2 = parse_transforms("nopad")["nopad"](lm, prompt, None)
    assert p2.n_audio == n_real and p2.n_prompt == prompt.n_prompt - (prompt.n_audio - n_real)
    assert p2.transform == "nopad" and not p2.audio_padding.any()
    np.testing.assert_array_equal(p2.audio_start_s, prompt.audio_start_s[:n_real])
    emb, a0 = lm.embed(prompt), int(prompt.audio_positions[0])
    # exact: the kept rows are copies of the original embeddings
    torch.testing.assert_close(p2.inputs_embeds[:, : a0 + n_real], emb[:, : a0 + n_real], rtol=0, atol=0)
    torch.testing.assert_close(p2.inputs_embeds[:, a0 + n_real:], emb[:, a0 + prompt.n_audio:], rtol=0, atol=0)
    run = live_generate(lm, p2, PolicySpec("wnw", 0.3), LiveConfig(4, head_scores=scores))
    assert run.summary["input_retention"] == pytest.approx(n_real / prompt.n_audio)
    assert run.summary["n_audio"] == n_real


def test_nopad_needs_to_know_the_padding(setup):
    import dataclasses

    from kvsim.tracer.transforms import parse_transforms

    lm, prompt, _, _ = setup
    with pytest.raises(ValueError, match="does not say which audio tokens are padding"):
        parse_transforms("nopad")["nopad"](lm, dataclasses.replace(prompt, audio_padding=None), None)
