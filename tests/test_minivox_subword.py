"""Subword regularisation of minivox's training transcripts (``TrainConfig.split_words``):
the pieces spell the same text, the draw follows the share, the guided targets follow each
piece's word, and the trainer scores the pieces."""

from __future__ import annotations

import random

import numpy as np
import pytest
import soundfile as sf
import torch

from kvsim.minivox.guided import target_spans, token_words, word_char_spans
from kvsim.minivox.subword import CUTTABLE, encode, split_words

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
CORPUS = ["the catalogue of dogs sat on the mat", "a dog ran far", "catalogue of cats",
          "system user assistant you are a helpful ai named smollm trained by hugging face",
          "transcribe the audio."]
TEXTS = ["The catalogue, of dogs!", "a dog ran far, then the cats sat on a mat.",
         "Catalogue catalogue: dogs' mats", "zebras quickly jumped"]


@pytest.fixture(scope="module")
def tok():
    """A small byte-level BPE tokenizer (offsets spell the leading space, as SmolLM2's do)
    with minivox's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.test_minivox_model import SMOL_TEMPLATE

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<|endoftext|>",
                                  eos_token="<|im_end|>", pad_token="<|im_end|>")
    out.add_special_tokens({"additional_special_tokens": SPECIALS})
    out.chat_template = SMOL_TEMPLATE
    return out


def test_share_zero_is_the_tokenizers_own_encoding(tok):
    for text in TEXTS:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        got = split_words(tok, text, 0.0, None)
        assert got.ids == enc["input_ids"] and got.offsets == [tuple(o) for o in enc["offset_mapping"]]
        assert got == encode(tok, text)
    with pytest.raises(ValueError, match="needs a random draw"):
        split_words(tok, TEXTS[0], 0.1, None)


def test_every_long_word_is_cut_into_pieces_that_spell_it(tok):
    for seed in range(5):
        for text in TEXTS:
            whole, cut = encode(tok, text), split_words(tok, text, 1.0, random.Random(seed))
            assert tok.decode(cut.ids) == text
            for i, (a, b) in zip(cut.ids, cut.offsets, strict=True):
                assert tok.decode([i]) == text[a:b]  # each offset is what its token spells
            assert [b for _, b in cut.offsets] == [a for a, _ in cut.offsets[1:]] + [len(text)]
            for word in CUTTABLE.finditer(text):
                inside = [o for o in cut.offsets if word.start() <= o[1] and o[0] < word.end()]
                assert len(inside) >= 2, (text, word.group())
            # words under four letters keep their own tokens
            short = {o: i for i, o in zip(whole.ids, whole.offsets, strict=True)
                     if not any(w.start() < o[1] and o[0] < w.end() for w in CUTTABLE.finditer(text))}
            assert all(cut.ids[cut.offsets.index(o)] == i for o, i in short.items())


def _words_cut(text: str, offsets: list[tuple[int, int]]) -> int:
    return sum(sum(w.start() < b and a < w.end() for a, b in offsets) > 1
               for w in CUTTABLE.finditer(text))


def test_the_cut_words_and_cut_points_follow_the_draw(tok):
    text = " ".join(["catalogue"] * 400)
    assert len(encode(tok, "catalogue").ids) == 1 and _words_cut(text, encode(tok, text).offsets) == 0
    counts = []
    for seed in range(3):
        got = split_words(tok, text, 0.5, random.Random(seed))
        assert got == split_words(tok, text, 0.5, random.Random(seed))
        counts.append(_words_cut(text, got.offsets))
    # 400 draws of p = 0.5 cut 200 +- 50 words (5 standard deviations)
    assert all(150 <= c <= 250 for c in counts) and len(set(counts)) > 1
    spellings = {tuple(split_words(tok, "catalogue", 1.0, random.Random(s)).offsets)
                 for s in range(60)}
    assert len(spellings) == 8  # one spelling per cut point of the 9 letters


def test_guided_spans_give_each_piece_its_words_interval(tok):
    row = {"text": "The catalogue, of dogs!", "words": ["The", "catalogue", "of", "dogs"],
           "word_start": [0.1, 0.5, 1.9, 2.3], "word_end": [0.4, 1.8, 2.1, 2.9]}
    cut = split_words(tok, row["text"], 1.0, random.Random(3))
    spans = target_spans(tok, row, [375], 0.4, offsets=cut.offsets)
    assert spans.shape == (len(cut.ids), 2) and len(cut.ids) > len(encode(tok, row["text"]).ids)
    words = token_words(cut.offsets, word_char_spans(row["text"], row["words"]))
    for (lo, hi), w in zip(spans, words, strict=True):
        assert lo == max(0, int(np.floor((row["word_start"][w] - 0.4) * 12.5)))
        assert hi == int(np.ceil((row["word_end"][w] + 0.4) * 12.5))
    assert np.array_equal(target_spans(tok, row, [375], 0.4),
                          target_spans(tok, row, [375], 0.4, offsets=encode(tok, row["text"]).offsets))


def test_the_trainer_scores_the_pieces_and_guides_them(tok, tmp_path):
    from transformers import LlamaConfig, VoxtralEncoderConfig

    from kvsim.minivox.modeling import MinivoxConfig, MinivoxForConditionalGeneration
    from kvsim.minivox.processing import MinivoxProcessor
    from kvsim.minivox.train import TrainConfig, check_training_options, make_batch

    audio = VoxtralEncoderConfig(hidden_size=8, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_mel_bins=80, max_source_positions=1500)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = MinivoxForConditionalGeneration(MinivoxConfig(
        audio_config=audio, text_config=text,
        audio_token_id=tok.convert_tokens_to_ids("<empty_output>")))
    proc = MinivoxProcessor(tok, "<empty_output>")
    sf.write(tmp_path / "clip.wav", np.zeros(16000 * 3, dtype=np.float32), 16000)
    row = {"id": "clip", "abs_path": str(tmp_path / "clip.wav"), "duration": 3.0,
           "text": "The catalogue of dogs", "words": ["The", "catalogue", "of", "dogs"],
           "word_start": [0.1, 0.5, 1.9, 2.3], "word_end": [0.4, 1.8, 2.1, 2.9]}
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        plain = make_batch(model, proc, [row], None, 0.4)
        cut = make_batch(model, proc, [row], None, 0.4, split_share=1.0,
                         split_draw=random.Random(7))
    want = split_words(tok, row["text"], 1.0, random.Random(7)).ids + [end]
    assert cut.labels[cut.labels != -100].tolist() == want
    assert plain.labels[plain.labels != -100].tolist() == encode(tok, row["text"]).ids + [end]
    assert len(cut.guides[0].query_positions) == len(want) - 1  # one per transcript token
    with pytest.raises(ValueError, match="split_share > 0 needs split_draw"):
        make_batch(model, proc, [row], None, 0.4, split_share=0.5)
    with pytest.raises(ValueError, match="--split-words 1.5"):
        check_training_options(TrainConfig(split_words=1.5))
