"""The encoder swap (``kvsim.minivox.swap``): a projector for another Whisper encoder fitted to
a trained projector's outputs, the decoder's LoRA factors carried over unchanged."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from kvsim.minivox import swap
from kvsim.minivox.align import projector
from kvsim.minivox.build import adapter_encoder, read_adapter, save_adapter, split_adapter
from kvsim.minivox.swap import (
    SwapConfig,
    cosine_lr,
    fit_quality,
    least_squares_layer,
    least_squares_student,
    parse_args,
    stack_frames,
    swap_adapter,
    teacher_projector,
    train_student,
)
from tests.test_minivox_encoder_choice import _model


def test_stack_frames_puts_four_consecutive_frames_in_one_token():
    frames = torch.arange(2 * 1500 * 3, dtype=torch.float32).reshape(3000, 3)
    tokens = stack_frames(frames)
    assert tokens.shape == (750, 12)
    t = 401  # token t holds frames 4t .. 4t+3, in order
    assert torch.equal(tokens[t], frames[4 * t:4 * t + 4].reshape(-1))


def test_the_teacher_is_the_models_own_projector():
    model = _model(width=8)
    state = model.model.multi_modal_projector.state_dict()
    x = torch.randn(50, 32)
    with torch.no_grad():
        want = model.model.multi_modal_projector(x)
    got = teacher_projector(state)(x)
    assert got.shape == (50, 16) == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_fit_quality_of_known_predictions():
    y = torch.randn(40, 576, dtype=torch.float64).float()
    assert fit_quality(torch.nn.Identity(), y, y) == {"relative_error": 0.0, "cosine": pytest.approx(1.0)}
    doubled = fit_quality(lambda v: 2 * v, y, y)
    assert doubled["relative_error"] == pytest.approx(1.0, rel=1e-5)
    assert doubled["cosine"] == pytest.approx(1.0, abs=1e-5)
    assert fit_quality(lambda v: -v, y, y)["cosine"] == pytest.approx(-1.0, abs=1e-5)


def test_cosine_lr_warms_up_then_decays_to_zero():
    assert [cosine_lr(s, 100, 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine_lr(52, 100, 4) == pytest.approx(0.5)
    assert cosine_lr(100, 100, 4) == pytest.approx(0.0, abs=1e-12)


def _teacher_and_mix(seed: int = 0):
    """A teacher projector on 32 features, and a mix that makes 40 student features of the
    teacher's (of full rank: the student's features carry the same information, so a perfect
    student exists)."""
    g = torch.Generator().manual_seed(seed)
    teacher = teacher_projector({"linear_1.weight": torch.randn(576, 32, generator=g) / 6,
                                 "linear_2.weight": torch.randn(576, 576, generator=g) / 24})
    return teacher, torch.randn(32, 40, generator=g) / 6


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))


def test_least_squares_layer_recovers_a_linear_map_and_shrinks_with_the_ridge():
    x = torch.randn(2000, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    w = torch.randn(4, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    exact = least_squares_layer(x.float(), (x @ w.T).float(), ridge=0.0, chunk=300)
    assert torch.allclose(exact.double(), w, atol=1e-4)
    shrunk = least_squares_layer(x.float(), (x @ w.T).float(), ridge=1.0, chunk=300)
    assert shrunk.norm() < 0.75 * w.norm()


def test_the_least_squares_student_gives_the_teachers_outputs_from_other_features():
    teacher, mix = _teacher_and_mix()
    x_train, x_held = _tokens(3000, 1), _tokens(500, 2)
    student = least_squares_student(x_train @ mix, teacher, teacher[0](x_train), ridge=1e-6)
    assert torch.equal(student[2].weight, teacher[2].weight)
    fit = fit_quality(student, x_held @ mix, teacher(x_held))
    assert fit["relative_error"] < 1e-3 and fit["cosine"] > 0.999


def test_training_brings_a_student_to_the_teachers_outputs():
    teacher, mix = _teacher_and_mix()
    x_train, x_held = _tokens(3000, 1), _tokens(500, 2)
    torch.manual_seed(0)
    student = projector(40, None, 576)  # a random first layer, not the least-squares one
    student[2].weight.data.copy_(teacher[2].weight)
    before = fit_quality(student, x_held @ mix, teacher(x_held))
    cfg = SwapConfig(epochs=30, batch_tokens=128, lr=1e-2)
    student = train_student(student, x_train @ mix, teacher(x_train), cfg, log=lambda *a: None)
    after = fit_quality(student, x_held @ mix, teacher(x_held))
    assert before["relative_error"] > 0.5
    assert after["relative_error"] < 0.1 and after["cosine"] > 0.95


def _source_adapter(path, encoder: str = "tiny.en", encoder_lora: bool = False) -> dict:
    model = _model(width=8)
    lora = {"layers.0.self_attn.q_proj.A": torch.randn(2, 16), "layers.0.self_attn.q_proj.B": torch.randn(16, 2)}
    save_adapter(path, model.model.multi_modal_projector.state_dict(), lora,
                 {"encoder": encoder, "step": 60, "lineage": "run11 -> runN10 60"},
                 encoder_lora={"layers.0.fc1.A": torch.ones(2, 8)} if encoder_lora else None)
    return lora


def _fake_corpus(monkeypatch, n_train: int = 12, n_dev: int = 4):
    """A corpus of ``n_train`` + ``n_dev`` one-window clips whose features on tiny.en (8 wide) and
    base (10 wide) are random and carry the same information."""
    class Split:
        def __init__(self, ids):
            self.ids = ids

        def to_dicts(self):
            return [{"id": i} for i in self.ids]

    splits = {"train_wide": [f"tw{i}" for i in range(n_train)], "dev": [f"d{i}" for i in range(n_dev)]}
    monkeypatch.setattr(swap, "read_manifest", lambda data, split: Split(splits[split]))
    mix = torch.randn(32, 40, generator=torch.Generator().manual_seed(1)) / 6

    def tokens(data, groups, encoder):
        out = []
        for rows in groups:
            x = torch.cat([torch.randn(375, 32, generator=torch.Generator().manual_seed(zlib.crc32(r["id"].encode())))
                           for r in rows])
            out.append((x if encoder == "tiny.en" else x @ mix).half())
        return out

    monkeypatch.setattr(swap, "encoder_tokens", tokens)


def test_swap_writes_an_adapter_of_the_new_encoder_with_the_lora_unchanged(tmp_path, monkeypatch):
    src = tmp_path / "src.safetensors"
    lora = _source_adapter(src)
    _fake_corpus(monkeypatch)
    cfg = SwapConfig(adapter=src, encoder="base", out=tmp_path / "base.safetensors", clips=12,
                     dev_clips=4, epochs=20, batch_tokens=512, lr=3e-3)
    quality = swap_adapter(cfg, log=lambda *a: None)
    tensors, meta = read_adapter(cfg.out)
    parts = split_adapter(tensors)
    assert adapter_encoder(meta, cfg.out) == "base"
    assert parts.projector["linear_1.weight"].shape == (16, 40)
    assert parts.lora.keys() == lora.keys()
    assert all(torch.equal(parts.lora[k], lora[k]) for k in lora)
    assert json.loads(meta["step"]) == 60
    assert json.loads(meta["lineage"]).startswith("run11 -> runN10 60 -> encoder swap tiny.en to base")
    record = json.loads(meta["swap"])
    assert record["relative_error"] == quality["relative_error"] < 0.01
    assert record["least_squares_relative_error"] < 0.01
    assert record["source_encoder"] == "tiny.en" and record["clips"] == 12
    assert not list(tmp_path.glob("base.safetensors.tmp*"))  # no temporary file left


@pytest.mark.parametrize(("encoder", "encoder_lora", "message"), [
    ("base", False, "already an adapter of Whisper base's encoder"),
    ("tiny.en", True, "trains its encoder too"),
])
def test_swap_refuses_what_it_cannot_carry_over(tmp_path, monkeypatch, encoder, encoder_lora, message):
    src = tmp_path / "src.safetensors"
    _source_adapter(src, encoder=encoder, encoder_lora=encoder_lora)
    _fake_corpus(monkeypatch)
    with pytest.raises(ValueError, match=message) as err:
        swap_adapter(SwapConfig(adapter=src, encoder="base", out=tmp_path / "o.safetensors"))
    assert str(src) in str(err.value)
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize(("n_train", "n_dev", "message"), [
    (5, 24, "split train_wide has 5 clips, --clips asks for 1500"),
    (1500, 20, "split dev has 20 clips, --dev-clips asks for 24"),
])
def test_swap_refuses_a_split_with_fewer_clips_than_asked(tmp_path, monkeypatch, n_train, n_dev, message):
    src = tmp_path / "src.safetensors"
    _source_adapter(src)
    _fake_corpus(monkeypatch, n_train=n_train, n_dev=n_dev)
    with pytest.raises(ValueError, match=message):
        swap_adapter(SwapConfig(adapter=src, encoder="base", out=tmp_path / "o.safetensors"))


def test_every_option_has_help_and_parses():
    cfg = parse_args(["--adapter", "a.safetensors", "--clips", "7", "--encoder", "base"])
    assert cfg.clips == 7 and str(cfg.adapter) == "a.safetensors"
    with pytest.raises(SystemExit):
        parse_args(["--encoder", "large"])


def test_the_command_names_a_missing_adapter_in_one_line(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(SystemExit) as err:
        swap.main(["--adapter", str(missing), "--out", str(tmp_path / "o.safetensors")])
    assert str(err.value) == f"error: {missing}: minivox adapter not found"
