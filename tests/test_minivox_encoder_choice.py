"""minivox on another Whisper encoder (``--encoder base``): the adapter records its encoder,
the cache builds an adapter on the encoder it names, and training refuses to mix encoders
(an adapter, a stage-1 projector or a checkpoint of another one) in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from kvsim.minivox.build import (
    _adapter_key,
    adapter_encoder,
    adapter_metadata,
    average_adapters,
    compact_adapter,
    ensure_cached,
    save_adapter,
)
from kvsim.minivox.modeling import (
    WHISPER_ENCODERS,
    MinivoxConfig,
    MinivoxForConditionalGeneration,
    build_config,
)
from kvsim.minivox.processing import MinivoxProcessor
from kvsim.minivox.train import (
    TrainConfig,
    build_parser,
    config_from_args,
    encoder_cache_dir,
    export,
    load_stage1_projector,
    load_trainable_adapter,
    optimizer,
    save_ckpt,
    start_or_resume,
    trainable,
)
from kvsim.whisper import WHISPER_PACKAGES
from tests.test_minivox_encoder_lora import _model as _tiny_minivox
from tests.test_minivox_model import _tiny_tokenizer


def _model(encoder: str = "tiny.en", width: int = 8) -> MinivoxForConditionalGeneration:
    """A tiny minivox whose config names ``encoder``; the projector reads 4 * ``width``."""
    return _tiny_minivox(encoder_layers=1, encoder=encoder, width=width)


def _adapter(path, model, meta: dict) -> None:
    save_adapter(path, model.model.multi_modal_projector.state_dict(), {}, meta)


def test_an_adapter_names_its_encoder_and_old_ones_are_tiny_en(tmp_path):
    model = _model()
    for meta, want in (({}, "tiny.en"), ({"encoder": "base"}, "base"),
                       ({"encoder": "tiny.en"}, "tiny.en")):
        _adapter(tmp_path / "a.safetensors", model, meta)
        assert adapter_encoder(adapter_metadata(tmp_path / "a.safetensors"), "a") == want
    from safetensors.torch import load_file

    raw = tmp_path / "raw.safetensors"  # metadata written by another tool, not JSON-encoded
    save_file(load_file(str(tmp_path / "a.safetensors")), str(raw),
              metadata={"format": "minivox-adapter-v1", "encoder": "large-v3"})
    with pytest.raises(ValueError, match=r"^raw: metadata encoder='large-v3': not one of"):
        adapter_encoder(adapter_metadata(raw), "raw")
    _adapter(tmp_path / "b.safetensors", model, {"encoder": "large-v3"})
    with pytest.raises(ValueError, match=r"^b\.safetensors: metadata encoder='large-v3': not one of tiny\.en, base$"):
        adapter_encoder(adapter_metadata(tmp_path / "b.safetensors"), "b.safetensors")


def test_a_trained_adapter_records_its_encoder_and_keeps_it_when_compacted(tmp_path):
    model = _model("base")
    export(tmp_path, TrainConfig(encoder="base"), model, 3, 0.5, "last.safetensors")
    meta = adapter_metadata(tmp_path / "last.safetensors")
    assert adapter_encoder(meta, "last") == "base"
    assert json.loads(meta["train_config"])["encoder"] == "base"
    compact_adapter(tmp_path / "last.safetensors", tmp_path / "kept.safetensors")
    assert adapter_encoder(adapter_metadata(tmp_path / "kept.safetensors"), "kept") == "base"


def test_the_config_carries_the_encoder_and_its_geometry():
    text = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    for name, geometry in WHISPER_ENCODERS.items():
        cfg = build_config(text, 3, "<empty_output>", name)
        assert cfg.whisper_encoder == name
        assert cfg.audio_config.hidden_size == geometry["hidden_size"]
        # the projector stacks 4 encoder frames: its input is the config's intermediate size
        assert cfg.audio_config.intermediate_size == 4 * geometry["hidden_size"]
        assert MinivoxConfig.from_dict(cfg.to_dict()).whisper_encoder == name
    assert MinivoxConfig().whisper_encoder == "tiny.en"  # builds from before the field


def test_each_encoder_has_its_own_feature_cache_and_build_key(tmp_path):
    assert encoder_cache_dir(tmp_path) == tmp_path / "enc_cache"
    assert encoder_cache_dir(tmp_path, "tiny.en") == tmp_path / "enc_cache"
    assert encoder_cache_dir(tmp_path, "base") == tmp_path / "enc_cache_base"
    assert _adapter_key(None, "tiny.en") != _adapter_key(None, "base")
    assert WHISPER_PACKAGES.keys() == WHISPER_ENCODERS.keys()  # every encoder has its packages


def test_training_refuses_an_adapter_of_another_encoder(tmp_path):
    path = tmp_path / "base.safetensors"
    src = _model("base")
    _adapter(path, src, {"encoder": "base"})
    with pytest.raises(ValueError, match=r"base\.safetensors: an adapter of Whisper base's "
                                         r"encoder; this run's is tiny\.en's \(--encoder\)"):
        load_trainable_adapter(_model("tiny.en"), path)
    dst = _model("base")
    assert load_trainable_adapter(dst, path) == "encoder frozen"
    for k, v in src.model.multi_modal_projector.state_dict().items():
        assert torch.equal(dst.model.multi_modal_projector.state_dict()[k], v), k


def test_a_stage1_projector_of_another_width_is_refused(tmp_path):
    wide = _model("base", width=12)
    path = tmp_path / "align.safetensors"
    save_file({k: v.contiguous() for k, v in wide.model.multi_modal_projector.state_dict().items()},
              str(path))
    with pytest.raises(ValueError, match=r"align\.safetensors: a projector for 48 input features; "
                                         r"Whisper tiny\.en's encoder gives 32 \(--encoder\)"):
        load_stage1_projector(_model("tiny.en"), path)
    same = _model("base", width=12)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in same.model.multi_modal_projector.parameters():
            p.copy_(torch.randn_like(p))
    load_stage1_projector(same, path)
    for k, v in wide.model.multi_modal_projector.state_dict().items():
        assert torch.equal(same.model.multi_modal_projector.state_dict()[k], v), k


def test_a_run_does_not_resume_on_another_encoder(tmp_path):
    cfg = TrainConfig(encoder="base")
    saved = _model("base")
    opt, sched = optimizer(cfg, *trainable(saved))
    save_ckpt(tmp_path / "last.pt", saved, opt, sched, 4, 0.5, cfg)
    other = _model("tiny.en")
    opt2, sched2 = optimizer(TrainConfig(), *trainable(other))
    with pytest.raises(ValueError, match=r"last\.pt: a run on Whisper base's encoder; this one "
                                         r"asks for tiny\.en's"):
        start_or_resume(tmp_path, other, None, opt2, sched2, [], tmp_path, None, None, lead=False)
    same = _model("base")
    opt3, sched3 = optimizer(cfg, *trainable(same))
    assert start_or_resume(tmp_path, same, None, opt3, sched3, [], tmp_path, None, None,
                           lead=False)[0] == 4


def test_adapters_of_two_encoders_are_not_averaged(tmp_path):
    model = _model()
    _adapter(tmp_path / "a.safetensors", model, {})
    _adapter(tmp_path / "b.safetensors", model, {"encoder": "base"})
    with pytest.raises(ValueError, match=r"different Whisper encoders \(base, tiny\.en\)"):
        average_adapters([tmp_path / "a.safetensors", tmp_path / "b.safetensors"],
                         tmp_path / "soup.safetensors")
    _adapter(tmp_path / "c.safetensors", model, {"encoder": "base"})
    soup = average_adapters([tmp_path / "b.safetensors", tmp_path / "c.safetensors"],
                            tmp_path / "soup.safetensors")
    assert adapter_encoder(adapter_metadata(soup), "soup") == "base"


def test_the_trainer_command_line_takes_only_known_encoders(capsys):
    assert config_from_args(build_parser().parse_args(["--encoder", "base"])).encoder == "base"
    assert config_from_args(build_parser().parse_args([])).encoder == "tiny.en"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--encoder", "large-v3"])
    assert "invalid choice: 'large-v3'" in capsys.readouterr().err


def test_the_cache_builds_an_adapter_on_the_encoder_it_names(tmp_path, monkeypatch):
    """ensure_cached: an untrained build on the asked encoder, an adapter on its own (the
    backbone conversion replaced by tiny models that record which encoder was asked for)."""
    import kvsim.minivox.build as build

    asked = []

    def fake_build_base(seed=0, dtype=torch.float32, encoder="tiny.en"):
        asked.append(encoder)
        return _model(encoder), MinivoxProcessor(_tiny_tokenizer(), "<empty_output>")

    monkeypatch.setattr(build, "build_base", fake_build_base)
    monkeypatch.setattr(build, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(build, "_adapter_key",
                        lambda ad, enc: f"{enc}-{ad.name if ad else 'untrained'}")
    src = _model("base")
    with torch.no_grad():
        for p in src.model.multi_modal_projector.parameters():
            p.add_(1.0)
    path = tmp_path / "base.safetensors"
    _adapter(path, src, {"encoder": "base"})
    out = ensure_cached(path)
    assert out.name == "base-base.safetensors" and asked == ["base"]
    assert json.loads((out / "minivox_processor.json").read_text())["encoder"] == "base"
    built = MinivoxForConditionalGeneration.from_pretrained(str(out))
    assert built.config.whisper_encoder == "base"
    for k, v in src.model.multi_modal_projector.state_dict().items():
        assert torch.equal(built.model.multi_modal_projector.state_dict()[k], v), k
    assert ensure_cached(path) == out and asked == ["base"]  # cached: nothing rebuilt
    assert ensure_cached(untrained=True).name == "tiny.en-untrained" and asked == ["base", "tiny.en"]
