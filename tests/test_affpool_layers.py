"""AffPool inside the decoder (WnW App. F): pooling at the output of the first layers, live."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvsim.live.decode import (
    LiveConfig,
    _cache_kw,
    _prefill_forward,
    live_generate,
    plain_generate,
)
from kvsim.live.models import TinyBackbone, TinyConfig
from kvsim.replay.engine import PolicySpec
from kvsim.tracer.transforms import parse_transforms
from kvsim.tracer.transforms.affpool import adjacent_affinity, groups_for
from kvsim.tracer.transforms.affpool_layers import (
    LayerPoolConfig,
    calibrate_layer_threshold,
    decoder_layers,
    measure_retention,
)

torch.set_num_threads(1)
N_LAYERS, N_POOL = 4, 2


def _audio(seed: int, seconds: float = 10.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    audio = (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)
    audio[16000 * 2: 16000 * 5] *= 0.01  # near-silence: similar frames
    return audio


@pytest.fixture(scope="module")
def tiny():
    lm = TinyBackbone(TinyConfig(n_layers=N_LAYERS, n_q_heads=4, n_kv_heads=2))
    return lm, lm.prepare(_audio(0))


def _pooled(lm, prompt, threshold: float, n_pool: int = N_POOL):
    import dataclasses

    return dataclasses.replace(prompt, layer_pool=LayerPoolConfig(threshold, n_pool_layers=n_pool),
                               transform=f"affpool_layers:{threshold}")


def test_layers_after_each_pooling_layer_hold_the_pooled_audio(tiny):
    """τ below every affinity: each pooling layer merges every run of 3 surviving tokens, so
    layer l + 1 holds ceil(n_l / 3) audio KV entries; layers after the last pooling layer keep
    that length; the text KV is untouched; a decode step appends one entry to every layer."""
    lm, prompt = tiny
    t_a, n_text = prompt.n_audio, prompt.n_prompt - prompt.n_audio
    want = [t_a]
    for layer in range(1, N_LAYERS):
        want.append(math.ceil(want[-1] / 3) if layer <= N_POOL else want[-1])
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        _, retention = _prefill_forward(lm, _pooled(lm, prompt, -2.0), cache)
    assert [cache.layers[i].keys.shape[-2] - n_text for i in range(N_LAYERS)] == want
    assert retention == pytest.approx(np.mean(want) / t_a, rel=1e-12)
    with torch.no_grad():
        lm.model(input_ids=torch.tensor([[5]]), **_cache_kw(lm.model, cache), use_cache=True,
                 cache_position=torch.tensor([prompt.n_prompt]), logits_to_keep=1)
    assert [cache.layers[i].keys.shape[-2] - n_text - 1 for i in range(N_LAYERS)] == want


def test_masked_prefill_equals_a_physically_shorter_sequence(tiny):
    """One pooling layer (layer 0): the pooled model's prefill (members masked out of layers
    1.. and removed from their cache) equals running layers 1.. on the shortened sequence, the
    merged tokens at their first member's position. Tolerance: float32 rounding of sums over
    a different number of (exactly zero-weight) terms, ~1e-6 relative; 1e-4 leaves margin."""
    lm, prompt = tiny
    model = lm.model
    emb = lm.embed(prompt)
    with torch.no_grad():
        hs = model(inputs_embeds=emb, output_hidden_states=True, use_cache=False).hidden_states
    h0 = hs[1][0]  # output of layer 0
    a0, t_a = int(prompt.audio_positions[0]), prompt.n_audio
    groups = groups_for(adjacent_affinity(h0[a0:a0 + t_a]), 0.2, 3)
    assert sum(b - a > 1 for a, b in groups) >= 5  # the threshold really merges
    rows = [h0[:a0]] + [h0[a0 + a:a0 + b].mean(0, keepdim=True) for a, b in groups] + [h0[a0 + t_a:]]
    pos = np.r_[np.arange(a0), [a0 + a for a, _ in groups], np.arange(a0 + t_a, h0.shape[0])]
    h = torch.cat(rows)[None]
    pos_t = torch.as_tensor(pos)[None]
    inner = model.model
    pe = inner.rotary_emb(h, pos_t)
    with torch.no_grad():
        for layer in decoder_layers(model, N_LAYERS, model.config.get_text_config()._attn_implementation)[1:]:
            h = layer(h, attention_mask=None, position_embeddings=pe, position_ids=pos_t)
        ref = model.lm_head(inner.norm(h))[0, -1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out, _ = _prefill_forward(lm, _pooled(lm, prompt, 0.2, n_pool=1), cache)
    got = out.logits[0, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    assert cache.layers[1].keys.shape[-2] == len(pos)


def test_no_merge_threshold_is_token_identical_to_the_full_cache(tiny):
    lm, prompt = tiny
    fn = parse_transforms("affpool_layers:1.5")["affpool_layers:1.5"]
    pooled = fn(lm, prompt, None)
    assert pooled.transform == "affpool_layers:1.5" and pooled.n_audio == prompt.n_audio
    run = live_generate(lm, pooled, PolicySpec("full", 1.0), LiveConfig(max_new_tokens=12))
    full = live_generate(lm, prompt, PolicySpec("full", 1.0), LiveConfig(max_new_tokens=12))
    assert run.tokens == full.tokens == plain_generate(lm, prompt, 12)
    assert run.summary["input_retention"] == 1.0


def test_merging_changes_the_output_and_reports_its_retention(tiny):
    lm, prompt = tiny
    run = live_generate(lm, _pooled(lm, prompt, -2.0), PolicySpec("full", 1.0),
                        LiveConfig(max_new_tokens=12))
    assert run.summary["input_retention"] < 0.5
    assert run.summary["r_gpu_vs_original"] == run.summary["input_retention"]  # full keeps all
    with pytest.raises(ValueError, match="policy full"):
        live_generate(lm, _pooled(lm, prompt, -2.0), PolicySpec("snapkv", 0.5), LiveConfig(4))


def test_threshold_set_on_a_held_out_subset_meets_the_target(tiny):
    """App. F: τ calibrated on held-out prompts; their measured retention within two points."""
    lm, _ = tiny
    held_out = [lm.prepare(_audio(seed, 8.0)) for seed in (11, 12, 13)]
    cfg = LayerPoolConfig(1.0, n_pool_layers=N_POOL)
    tau, measured = calibrate_layer_threshold(lm, held_out, 0.7, cfg, iters=16)
    assert abs(measured - 0.7) <= 0.02
    assert measure_retention(lm, held_out, LayerPoolConfig(tau, n_pool_layers=N_POOL)) == measured
    with pytest.raises(ValueError, match="outside"):
        calibrate_layer_threshold(lm, held_out, 0.05, cfg, iters=2)


def test_plan_and_parse_errors():
    from kvsim.live.run import make_plan

    (item,) = make_plan(["affpool_layers:0.93/full"], [0.2])
    assert item.transform == "affpool_layers:0.93" and item.spec.name == "full"
    with pytest.raises(ValueError, match="affpool_layers:TAU"):
        parse_transforms("affpool_layers")
    with pytest.raises(ValueError, match="window"):
        LayerPoolConfig(0.5, window=1)


@pytest.mark.parametrize("family", ["voxtral", "qwen-omni"])
def test_real_backbone_text_decoder_is_pooled(family, tmp_path_factory):
    """On tiny Voxtral and Qwen2.5-Omni checkpoints (audio encoder + text decoder): the hooks
    find the text decoder, not the audio encoder; the layer after the pooling layer holds fewer
    audio KV entries; τ above every affinity decodes exactly as plain generation."""
    from kvsim.live.models import load_backbone
    from kvsim.tracer.audio import load_audio
    from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

    ckpt = tiny_checkpoint(family, tmp_path_factory.getbasetemp())
    wav = write_tone(tmp_path_factory.mktemp("ap") / "clip.wav", 4.0)
    lm = load_backbone(str(ckpt))
    prompt = lm.prepare(load_audio(wav, lm.sample_rate).samples)
    n_layers = lm.layout.n_layers
    assert decoder_layers(lm.model, n_layers, lm.text_config._attn_implementation)[0].self_attn.config is not None
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        _prefill_forward(lm, _pooled(lm, prompt, -2.0, n_pool=1), cache)
    lengths = [cache.layers[i].keys.shape[-2] for i in range(n_layers)]
    assert lengths[0] == prompt.n_prompt
    n_text = prompt.n_prompt - prompt.n_audio
    assert lengths[1:] == [n_text + math.ceil(prompt.n_audio / 3)] * (n_layers - 1)
    run = live_generate(lm, _pooled(lm, prompt, 1.5), PolicySpec("full", 1.0), LiveConfig(6))
    assert run.tokens == plain_generate(lm, prompt, 6)
