"""The alignment-guided attention loss (kvsim.minivox.guided): targets, probe, loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsim.minivox.guided import (
    TOKENS_PER_SECOND,
    AttentionProbe,
    GuideTargets,
    guided_loss,
    part_word_times,
    span_loss,
    speech_end,
    target_spans,
    token_words,
    word_char_spans,
)
from tests.float32_bounds import gamma


def test_word_char_spans_in_order_with_repeats() -> None:
    text = "The cat, the hat. The end!"
    spans = word_char_spans(text, ["The", "cat", "the", "hat", "The", "end"])
    assert [text[a:b] for a, b in spans] == ["The", "cat", "the", "hat", "The", "end"]
    assert spans[4][0] == 18  # the second "The" is found after "hat", not at 0
    with pytest.raises(ValueError, match="'dog'"):
        word_char_spans(text, ["The", "dog"])


def test_token_words_punctuation_goes_to_the_word_before() -> None:
    # "Hi, you there." as tokens "Hi" "," " you" " there" "."
    offsets = [(0, 2), (2, 3), (3, 7), (7, 13), (13, 14)]
    spans = word_char_spans("Hi, you there.", ["Hi", "you", "there"])
    assert token_words(offsets, spans).tolist() == [0, 0, 1, 2, 2]
    # a token before every word (a leading quote) belongs to the first word
    assert token_words([(0, 1), (1, 3)], [(1, 3)]).tolist() == [0, 0]


def test_part_word_times_offsets_joined_parts_by_their_tokens() -> None:
    a = {"words": ["x", "y"], "word_start": [0.0, 1.0], "word_end": [0.5, 2.0]}
    b = {"words": ["z"], "word_start": [0.4], "word_end": [0.8]}
    start, end, words = part_word_times({"parts": [a, b]}, [750, 375])
    assert words == ["x", "y", "z"]
    np.testing.assert_array_equal(start, [0.0, 12.5, 750 + 0.4 * TOKENS_PER_SECOND])
    np.testing.assert_array_equal(end, [6.25, 25.0, 750 + 0.8 * TOKENS_PER_SECOND])
    single, _, _ = part_word_times(b, [375])
    np.testing.assert_array_equal(single, [0.4 * TOKENS_PER_SECOND])
    with pytest.raises(ValueError, match="2 parts but 1"):
        part_word_times({"parts": [a, b]}, [750])


def _bpe_tokenizer():
    """A small byte-level BPE fast tokenizer trained in memory (offsets like SmolLM2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the cat sat on the mat", "a dog ran far", "catalogue of dogs"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_target_spans_cover_each_tokens_word_with_the_margin() -> None:
    tok = _bpe_tokenizer()
    row = {"text": "The catalogue, of dogs!", "words": ["The", "catalogue", "of", "dogs"],
           "word_start": [0.1, 0.5, 1.9, 2.3], "word_end": [0.4, 1.8, 2.1, 2.9]}
    margin = 0.4
    spans = target_spans(tok, row, [375], margin)
    enc = tok(row["text"], add_special_tokens=False, return_offsets_mapping=True)
    assert spans.shape == (len(enc["input_ids"]), 2)
    assert len(enc["input_ids"]) > 4  # some words are several tokens
    tw = token_words(enc["offset_mapping"], word_char_spans(row["text"], row["words"]))
    for (lo, hi), w in zip(spans, tw, strict=True):
        s, e = row["word_start"][w] * 12.5, row["word_end"][w] * 12.5
        assert lo == max(0, int(np.floor(s - margin * 12.5)))
        assert hi == int(np.ceil(e + margin * 12.5))
        assert lo <= s and e <= hi


def test_end_span_runs_from_the_last_word_to_the_end_of_the_speech() -> None:
    tok = _bpe_tokenizer()
    row = {"text": "The cat sat", "words": ["The", "cat", "sat"], "duration": 5.0,
           "word_start": [0.1, 0.5, 1.9], "word_end": [0.4, 1.8, 2.9]}
    words_only = target_spans(tok, row, [375], 0.4)
    spans = target_spans(tok, row, [375], 0.4, guide_end=True)
    np.testing.assert_array_equal(spans[:-1], words_only)  # one more row, the others unchanged
    assert spans[-1].tolist() == [int(np.floor(2.9 * 12.5 - 5)), int(np.ceil(5.0 * 12.5))]
    # a joined example: the end of the last part's speech after the earlier parts' windows
    first = {"words": ["a"], "word_start": [0.2], "word_end": [0.6], "duration": 1.0}
    assert speech_end({"parts": [first, row]}, [375, 375]) == 375 + 5.0 * 12.5
    joined = {"text": "a The cat sat", "parts": [first, row]}
    end = target_spans(tok, joined, [375, 375], 0.0, guide_end=True)[-1]
    assert end.tolist() == [int(np.floor(375 + 2.9 * 12.5)), int(np.ceil(375 + 5.0 * 12.5))]


def _tiny_llama(dtype=torch.float64):
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                      attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaModel(cfg).to(dtype).eval()


def _targets(n_audio: int, start: int, queries: range, spans) -> GuideTargets:
    return GuideTargets(torch.tensor(list(queries)), torch.arange(start, start + n_audio),
                        torch.tensor(spans))


def test_probe_attention_is_the_layers_softmax_over_the_audio() -> None:
    """The probe's recomputation equals the model's own attention weights (eager kernel),
    restricted to the audio columns and renormalised, head-averaged. The model runs in float64
    but transformers' eager kernel takes its softmax in float32: each of its weights is within
    a relative gamma_(n+2) (u = 2^-24, n = 16 keys) of the exact softmax of its logits, and
    renormalising over the 6 audio columns adds gamma_6 (the probe itself is float64). Measured
    difference 3.8e-8 relative; a wrong position, head or rotary angle gives O(0.01-1)."""
    model = _tiny_llama()
    ids = torch.randint(0, 50, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, 14:] = 0  # a padded row in the batch
    probe = AttentionProbe(model, [0, 2])
    with torch.no_grad(), probe.capture():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    t = _targets(6, 2, range(9, 14), [[0, 1]] * 5)
    for layer in (0, 2):
        for row in (0, 1):
            got = probe.audio_attention(layer, row, t)
            w = out.attentions[layer][row][:, 9:14, 2:8]
            want = (w / w.sum(-1, keepdim=True)).mean(0)
            torch.testing.assert_close(got, want, rtol=float(gamma(18) + gamma(6)), atol=0)


def test_span_loss_values() -> None:
    a = 10
    uniform = torch.full((3, a), 1.0 / a, dtype=torch.float64)
    spans = torch.tensor([[0, 2], [3, 8], [9, 10]])
    want = np.mean([np.log(a / 2), np.log(a / 5), np.log(a / 1)])
    assert abs(float(span_loss(uniform, spans)) - want) < 1e-14
    peaked = torch.zeros((3, a), dtype=torch.float64)
    peaked[0, 1] = peaked[1, 5] = peaked[2, 9] = 1.0
    assert float(span_loss(peaked, spans)) == 0.0
    peaked[2] = 0.0
    peaked[2, 0] = 1.0  # all its mass outside its span: large but finite
    want = -np.log(np.finfo(np.float64).tiny) / 3  # its mass floored at the smallest normal
    assert abs(float(span_loss(peaked, spans)) - want) < 1e-12


def test_span_loss_weights_scale_each_term_and_keep_the_mean_over_rows() -> None:
    a = 10
    uniform = torch.full((3, a), 1.0 / a, dtype=torch.float64)
    spans = torch.tensor([[0, 2], [3, 8], [9, 10]])
    weights = torch.tensor([1.0, 3.0, 0.0])
    want = (np.log(a / 2) + 3 * np.log(a / 5)) / 3  # divided by the 3 rows, not by sum(w)
    assert abs(float(span_loss(uniform, spans, weights)) - want) < 1e-14
    ones = torch.ones(3)
    assert float(span_loss(uniform, spans, ones)) == float(span_loss(uniform, spans))


def test_guided_loss_trains_attention_into_the_spans() -> None:
    """A few steps on the guided loss alone (in float32, as in training) move the guided
    layer's audio attention into each query's span: the loss falls and the in-span mass rises."""
    model = _tiny_llama(torch.float32).train()
    for p in model.parameters():
        p.requires_grad_(False)
    attn = model.layers[1].self_attn
    for p in (attn.q_proj.weight, attn.k_proj.weight):
        p.requires_grad_(True)
    ids = torch.randint(0, 50, (1, 20))
    t = _targets(10, 2, range(13, 19), [[0, 2], [2, 4], [4, 6], [5, 7], [7, 9], [8, 10]])
    probe = AttentionProbe(model, [1])
    opt = torch.optim.Adam([attn.q_proj.weight, attn.k_proj.weight], lr=0.05)
    losses = []
    for _ in range(40):
        with probe.capture():
            model(input_ids=ids)
        loss = guided_loss(probe, [t])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad(), probe.capture():
        model(input_ids=ids)
        prob = probe.audio_attention(1, 0, t)
    inside = [float(prob[r, lo:hi].sum()) for r, (lo, hi) in enumerate(t.spans.tolist())]
    assert min(inside) > 0.5


def test_guided_loss_needs_targets() -> None:
    probe = AttentionProbe(_tiny_llama(), [0])
    with pytest.raises(ValueError, match="no batch row"):
        guided_loss(probe, [None])


def _wrapped(llama):
    """The attributes of minivox that loss_fn reads, around a tiny Llama decoder."""
    from types import SimpleNamespace

    torch.manual_seed(1)
    head = torch.nn.Linear(llama.config.hidden_size, llama.config.vocab_size, bias=False).double()
    return SimpleNamespace(model=SimpleNamespace(language_model=llama), lm_head=head)


def _one_row_batch(guide: GuideTargets | None):
    """A 20-position batch row whose positions 13-18 are scored, with ``guide``."""
    from kvsim.minivox.train import Batch

    embeds = torch.randn(1, 20, 32, dtype=torch.float64)
    labels = torch.full((1, 20), -100)
    labels[0, 13:19] = torch.randint(0, 50, (6,))
    return Batch(embeds, torch.ones(1, 20, dtype=torch.long), labels, [guide])


def test_loss_fn_adds_the_weighted_guided_loss_or_only_measures_it() -> None:
    from kvsim.minivox.train import loss_fn

    llama = _tiny_llama()
    model = _wrapped(llama)
    t = _targets(10, 2, range(13, 19), [[0, 2], [2, 4], [4, 6], [5, 7], [7, 9], [8, 10]])
    batch = _one_row_batch(t)
    embeds = batch.embeds
    probe = AttentionProbe(llama, [1, 2])

    def grads(loss):
        llama.zero_grad()
        loss.backward()
        return llama.layers[1].self_attn.q_proj.weight.grad.clone()

    plain, none = loss_fn(model, batch)
    assert none is None
    g_plain = grads(plain)
    measured, value = loss_fn(model, batch, probe, 0.0)
    assert measured.item() == plain.item()  # measured only: the same loss, the same gradient
    torch.testing.assert_close(grads(measured), g_plain, rtol=0, atol=0)
    with torch.no_grad(), probe.capture():
        llama(inputs_embeds=embeds)
        want = float(guided_loss(probe, [t]))
    # float64 throughout: the same operations give the same value up to the last bits of the
    # final sum (1e-12 relative is ~4,500 ulps, and a missing or doubled term is O(1))
    assert value == pytest.approx(want, rel=1e-12)
    weighted, value2 = loss_fn(model, batch, probe, 0.5)
    assert value2 == pytest.approx(want, rel=1e-12)
    assert weighted.item() == pytest.approx(plain.item() + 0.5 * want, rel=1e-12)
    assert not torch.equal(grads(weighted), g_plain)  # the guided term trains the layer


def test_a_clip_whose_words_do_not_match_its_text_trains_unguided_with_one_warning(capsys) -> None:
    # 11 of the corpus's 10,458 clips have espeak word lists that do not follow their text
    # (train_wide-06487: "etc" listed twice, "the" missing); one in a batch crashed a run
    from kvsim.minivox.train import _guide

    tok = _bpe_tokenizer()
    good = {"id": "c-good", "text": "The cat sat", "words": ["The", "cat", "sat"],
            "word_start": [0.1, 0.5, 1.9], "word_end": [0.4, 1.8, 2.9]}
    bad = {**good, "id": "c-bad", "words": ["The", "cat", "etc"]}
    is_audio = torch.zeros(40, dtype=torch.bool)
    is_audio[2:32] = True
    assert _guide(tok, good, [375], is_audio, 34, 0.4) is not None
    assert _guide(tok, bad, [375], is_audio, 34, 0.4) is None
    assert _guide(tok, bad, [375], is_audio, 34, 0.4) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "c-bad" in err[0] and "'etc' not found" in err[0]


def test_loss_fn_without_any_guided_row_is_the_transcript_loss() -> None:
    from kvsim.minivox.train import loss_fn

    llama = _tiny_llama()
    model = _wrapped(llama)
    batch = _one_row_batch(None)
    plain, _ = loss_fn(model, batch)
    guided, value = loss_fn(model, batch, AttentionProbe(llama, [1]), 1.0)
    assert value is None and guided.item() == plain.item()
