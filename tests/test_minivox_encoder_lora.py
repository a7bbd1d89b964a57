"""Training minivox's audio encoder with LoRA (``TrainConfig.encoder_lora_layers``): which
layers are wrapped, that gradients reach them through the live encoder, and that the adapter
file carries, reloads, averages and merges the encoder's factors."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from kvsim.minivox.build import (
    ENCODER_LORA,
    apply_adapter,
    average_adapters,
    read_adapter,
    save_adapter,
    split_adapter,
)
from kvsim.minivox.lora import LoRALinear, lora_state
from kvsim.minivox.modeling import MinivoxConfig, MinivoxForConditionalGeneration
from kvsim.minivox.processing import MinivoxProcessor
from kvsim.minivox.train import (
    ENCODER_LORA_TARGETS,
    TrainConfig,
    add_encoder_lora,
    check_training_options,
    encoder_cache,
    load_trainable_adapter,
    make_batch,
    mark_trainable,
    part_encodings,
    trainable,
)
from tests.float32_bounds import gamma
from tests.test_minivox_model import _tiny_tokenizer


def _model(encoder_layers: int = 2, encoder: str = "tiny.en",
           width: int = 8) -> MinivoxForConditionalGeneration:
    """A tiny minivox whose config names the Whisper ``encoder``; its encoder is ``width``
    wide, so the projector reads 4 * ``width`` features."""
    from transformers import LlamaConfig, VoxtralEncoderConfig

    audio = VoxtralEncoderConfig(hidden_size=width, intermediate_size=4 * width,
                                 num_hidden_layers=encoder_layers, num_attention_heads=2,
                                 num_mel_bins=80, max_source_positions=1500)
    text = LlamaConfig(vocab_size=len(_tiny_tokenizer()), hidden_size=16, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return MinivoxForConditionalGeneration(
        MinivoxConfig(audio_config=audio, text_config=text, audio_token_id=3,
                      whisper_encoder=encoder))


@pytest.fixture(scope="module")
def proc():
    return MinivoxProcessor(_tiny_tokenizer(), "<empty_output>")


@pytest.fixture
def row(tmp_path):
    audio = (np.random.default_rng(0).standard_normal(16000 * 3) * 0.1).astype(np.float32)
    sf.write(tmp_path / "clip.wav", audio, 16000)
    return {"id": "clip", "abs_path": str(tmp_path / "clip.wav"), "text": "you are a helpful ai"}


def _randomise_lora(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g))


def test_only_the_last_layers_are_wrapped_and_the_encoder_starts_unchanged(proc, row):
    model = _model(encoder_layers=2)
    before = part_encodings(model, proc, row, None)[0].detach()
    names = add_encoder_lora(model, TrainConfig(encoder_lora_layers=1))
    assert sorted(names) == sorted(f"layers.1.{'self_attn.' if t.endswith('proj') else ''}{t}"
                                   for t in ENCODER_LORA_TARGETS)
    tower = model.model.audio_tower
    assert not any(isinstance(m, LoRALinear) for m in tower.layers[0].modules())
    # B starts at zero: the wrapped encoder computes exactly what Whisper's does
    assert torch.equal(part_encodings(model, proc, row, None)[0], before)
    proj, lora = trainable(model)
    enc = [p for n, p in tower.named_parameters() if "lora_" in n]
    assert len(enc) == 2 * len(ENCODER_LORA_TARGETS) and all(
        any(p is q for q in lora) for p in enc)
    with pytest.raises(ValueError, match="--encoder-lora-layers 3: from 0 to 2"):
        add_encoder_lora(_model(2), TrainConfig(encoder_lora_layers=3))
    with pytest.raises(ValueError, match="--encoder-lora-layers -1"):
        check_training_options(TrainConfig(encoder_lora_layers=-1))


def test_gradients_reach_the_encoder_lora_through_a_live_batch(proc, row, tmp_path):
    model = _model(encoder_layers=2)
    add_encoder_lora(model, TrainConfig(encoder_lora_layers=1))
    tower = model.model.audio_tower
    for p in model.parameters():
        p.requires_grad_(False)
    for p in [p for n, p in tower.named_parameters() if "lora_" in n]:
        p.requires_grad_(True)
    live = make_batch(model, proc, [row], None)
    live.embeds.float().pow(2).sum().backward()
    grads = {n: p.grad for n, p in tower.named_parameters() if "lora_B" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    # the cached encoding is the same function at B = 0, rounded to float16 on disk
    cached = encoder_cache(model, proc, row, tmp_path / "cache")
    now = part_encodings(model, proc, row, None)[0].detach()
    assert cached.shape == now.shape
    assert ((cached - now).abs() <= 2.0**-11 * now.abs() + 2.0**-24).all()


@pytest.mark.parametrize("lora_lr", [0.0, 5e-4])
def test_lora_lr_zero_trains_the_projector_alone(proc, row, lora_lr):
    model = _model(encoder_layers=2)
    add_encoder_lora(model, TrainConfig(encoder_lora_layers=1))
    _randomise_lora(model.model.audio_tower, 3)  # B != 0: the factors are on the live path
    for p in model.parameters():
        p.requires_grad_(False)
    proj, lora = trainable(model)
    mark_trainable(proj, lora, TrainConfig(lora_lr=lora_lr))
    make_batch(model, proc, [row], None).embeds.float().pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj)
    if lora_lr == 0:
        assert lora and all(p.grad is None for p in lora)
    else:
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def _encoder_adapter(tmp_path, name: str, seed: int):
    model = _model(encoder_layers=2)
    add_encoder_lora(model, TrainConfig(encoder_lora_layers=2))
    _randomise_lora(model.model.audio_tower, seed)
    path = tmp_path / name
    save_adapter(path, model.model.multi_modal_projector.state_dict(), {}, {"step": 1},
                 encoder_lora=lora_state(model.model.audio_tower))
    return path, lora_state(model.model.audio_tower)


def test_adapter_files_keep_the_encoder_factors_apart(tmp_path):
    path, enc = _encoder_adapter(tmp_path, "a.safetensors", 1)
    tensors, _ = read_adapter(path)
    assert {k for k in tensors if k.startswith(ENCODER_LORA)} == {ENCODER_LORA + k for k in enc}
    parts = split_adapter(tensors)
    assert parts.lora == {} and parts.encoder_lora.keys() == enc.keys()
    for k, v in enc.items():
        assert torch.equal(parts.encoder_lora[k], v)
    with pytest.raises(ValueError, match="adapter tensor extra.x: not a projector"):
        split_adapter({**tensors, "extra.x": torch.zeros(1)})


def test_apply_adapter_merges_the_encoder_factors_into_its_linear_layers(tmp_path):
    path, enc = _encoder_adapter(tmp_path, "a.safetensors", 2)
    model = _model(encoder_layers=2)
    base = {n: m.weight.detach().clone() for n, m in model.model.audio_tower.named_modules()
            if isinstance(m, torch.nn.Linear)}
    apply_adapter(model, read_adapter(path)[0])
    merged = dict(model.model.audio_tower.named_modules())
    for name, w in base.items():
        got = merged[name].weight.detach().double()
        if f"{name}.lora_A" not in enc:
            assert torch.equal(got, w.double()), name
            continue
        a, b = enc[f"{name}.lora_A"].double(), enc[f"{name}.lora_B"].double()
        # w + B @ A in float32: a rank-8 dot product, then one addition
        bound = float(gamma(a.shape[0] + 1)) * (w.double().abs() + b.abs() @ a.abs())
        assert ((got - (w.double() + b @ a)).abs() <= bound).all(), name
        assert not torch.equal(got, w.double()), name


def test_training_reloads_encoder_factors_or_starts_them_at_zero(tmp_path):
    path, enc = _encoder_adapter(tmp_path, "a.safetensors", 3)
    model = _model(encoder_layers=2)
    add_encoder_lora(model, TrainConfig(encoder_lora_layers=2))
    assert load_trainable_adapter(model, path) == "encoder LoRA loaded"
    got = lora_state(model.model.audio_tower)
    for k in enc:
        torch.testing.assert_close(got[k], enc[k], rtol=0, atol=0)
    frozen = _model(encoder_layers=2)  # the file's encoder factors would be dropped
    with pytest.raises(ValueError, match="give --encoder-lora-layers"):
        load_trainable_adapter(frozen, path)
    plain = tmp_path / "plain.safetensors"
    save_adapter(plain, frozen.model.multi_modal_projector.state_dict(), {}, {})
    assert load_trainable_adapter(frozen, plain) == "encoder frozen"
    fresh = _model(encoder_layers=2)
    add_encoder_lora(fresh, TrainConfig(encoder_lora_layers=1))
    assert load_trainable_adapter(fresh, plain).startswith("encoder LoRA from zero")
    assert all(v.abs().sum() == 0 for k, v in lora_state(fresh.model.audio_tower).items()
               if k.endswith("lora_B"))


def test_a_soup_averages_the_encoder_updates(tmp_path):
    (p1, e1), (p2, e2) = (_encoder_adapter(tmp_path, f"a{i}.safetensors", 10 + i)
                          for i in range(2))
    soup = split_adapter(read_adapter(average_adapters(
        [p1, p2], tmp_path / "soup.safetensors", dtype=torch.float32))[0])
    for k in (k for k in e1 if k.endswith(".lora_A")):
        kb = k.removesuffix("lora_A") + "lora_B"
        want = 0.5 * e1[kb].double() @ e1[k].double() + 0.5 * e2[kb].double() @ e2[k].double()
        mag = 0.5 * (e1[kb].double().abs() @ e1[k].double().abs()
                     + e2[kb].double().abs() @ e2[k].double().abs())
        got = soup.encoder_lora[kb].double() @ soup.encoder_lora[k].double()
        assert ((got - want).abs() <= 2 * float(gamma(17)) * mag).all(), k
    assert soup.lora == {}


def test_a_resumed_run_gets_its_encoder_factors_back(tmp_path):
    from kvsim.minivox.train import optimizer, save_ckpt, start_or_resume

    cfg = TrainConfig(encoder_lora_layers=1)
    runs = []
    for seed in (5, 6):  # the run that saves, and a fresh process that resumes
        model = _model(encoder_layers=2)
        add_encoder_lora(model, cfg)
        _randomise_lora(model.model.audio_tower, seed)
        opt, sched = optimizer(cfg, *trainable(model))
        runs.append((model, opt, sched))
    (saved, opt, sched), (resumed, opt2, sched2) = runs
    save_ckpt(tmp_path / "last.pt", saved, opt, sched, 3, 0.5, cfg)
    step, _ = start_or_resume(tmp_path, resumed, None, opt2, sched2, [], tmp_path, None, None,
                              lead=False)
    assert step == 3
    want, got = lora_state(saved.model.audio_tower), lora_state(resumed.model.audio_tower)
    assert want.keys() == got.keys() and want
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
