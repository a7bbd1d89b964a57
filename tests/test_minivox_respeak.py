"""minivox's re-spoken splits: test_new's words again with one speaking condition changed."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvsim.minivox import data as D
from kvsim.minivox import respeak as R
from kvsim.minivox.clip_audio import SAMPLE_RATE
from kvsim.minivox.espeak import _PUNCT


def _tts():
    from test_minivox_data import _tts

    return _tts()


def test_nearest_training_band_is_the_nearest_end_as_wide_as_the_held_out_bands():
    lo, hi = D.TRAIN_RATES
    assert R.nearest_training_band(lo - 1, D.TRAIN_RATES) == (lo, lo + 15)
    assert R.nearest_training_band(120, D.TRAIN_RATES) == (135, 150)
    assert R.nearest_training_band(208, D.TRAIN_RATES) == (180, 195)
    assert R.nearest_training_band(hi + 1, D.TRAIN_RATES) == (hi - 15, hi)
    for rate in (lo, 160, hi):  # a training rate is its own nearest
        assert R.nearest_training_band(rate, D.TRAIN_RATES) == (rate, rate)
    assert all(b - a + 1 == R.BAND_WIDTH for a, b in D.HELDOUT_RATE_BANDS)


def test_each_held_out_voice_maps_to_a_training_voice_of_its_accent():
    assert set(R.TRAINING_VOICE_OF) == set(D.HELDOUT_VOICES)
    for held_out, trained in R.TRAINING_VOICE_OF.items():
        assert trained in D.VOICES
        assert trained.partition("+")[0] == held_out.partition("+")[0]
    # the base voice itself wherever training speaks it without a variant
    bases = {v for v in D.VOICES if "+" not in v}
    for held_out, trained in R.TRAINING_VOICE_OF.items():
        if held_out.partition("+")[0] in bases:
            assert trained == held_out.partition("+")[0]


def test_respeak_condition_changes_only_the_factors_asked_for():
    kw = {"train_rates": D.TRAIN_RATES}
    assert R.respeak_condition("en+m6", 208, training_voice=False, training_rate=False,
                               **kw) == ("en+m6", (208, 208))
    assert R.respeak_condition("en+m6", 208, training_voice=True, training_rate=False,
                               **kw) == ("en", (208, 208))
    assert R.respeak_condition("en+m6", 120, training_voice=False, training_rate=True,
                               **kw) == ("en+m6", (135, 150))
    assert R.respeak_condition("en+m6", 208, training_voice=True, training_rate=True,
                               **kw) == ("en", (180, 195))
    with pytest.raises(ValueError, match="no training voice"):
        R.respeak_condition("en-us+f2", 150, training_voice=True, training_rate=False, **kw)


def test_the_twins_re_speak_test_new_and_are_test_splits():
    specs = {s.name: s for s in D.DataConfig().splits}
    twins = [s for s in specs.values() if s.respeak]
    assert {(s.training_voice, s.training_rate) for s in twins} == {
        (True, False), (False, True), (True, True)}
    names = [s.name for s in D.DataConfig().splits]
    for s in twins:
        assert s.respeak == "test_new" and s.n_clips == specs["test_new"].n_clips
        assert not s.name.startswith("train")  # never a training split
        assert names.index(s.name) > names.index("test_new")  # generated after its source


def test_a_drawn_split_record_has_no_respeak_fields():
    """Records written before re-spoken splits existed stay current: a corpus is not
    synthesised again because the spec grew fields."""
    spec = next(s for s in D.DataConfig().splits if s.name == "test_long")
    record = D.split_record(D.DataConfig(), spec, {}, "1.51")
    assert set(record["spec"]) == {"name", "n_clips", "min_s", "max_s", "pool", "voices",
                                   "rate_bands", "start"}
    twin = next(s for s in D.DataConfig().splits if s.respeak)
    assert D.split_record(D.DataConfig(), twin, {}, "1.51")["spec"]["respeak"] == "test_new"


def test_respeak_clip_reads_the_same_words_in_the_given_voice_and_band():
    tts = _tts()
    text = ("The books returned to the shelves are useful replacements. Most attendees "
            "gained much insight from this meeting.")
    clip = R.respeak_clip(tts, text, "en-us", (135, 150), random.Random(3))
    assert clip["text"] == text and clip["voice"] == "en-us" and 135 <= clip["rate"] <= 150
    assert clip["words"] == [w.strip(_PUNCT) for w in text.split()]
    dur = clip["audio"].size / SAMPLE_RATE
    starts, ends = clip["word_start"], clip["word_end"]
    assert starts[0] >= 0.1 and ends[-1] <= dur
    assert all(a <= b for a, b in zip(starts, starts[1:], strict=False))
    # a pause of at least 0.25 s between the two sentences
    assert starts[9] - ends[8] >= 0.25
    # a sentence whose words espeak reads otherwise ("the event": one word event) is an error,
    # not a clip whose words no longer match the source's
    with pytest.raises(RuntimeError, match="word events disagree"):
        R.respeak_clip(tts, "He came from the event.", "en-us", (142, 142), random.Random(0))


def test_generate_re_speaks_its_source_and_follows_its_record(tmp_path, capsys):
    import polars as pl

    _tts()
    if not D.FORTUNE_DIR.is_dir():
        pytest.skip(f"{D.FORTUNE_DIR} not installed")

    def cfg(seed=0):
        return D.DataConfig(seed=seed, splits=[
            D.SplitSpec("dev", 2, 3.0, 6.0),
            D.SplitSpec("dev_again", 2, 3.0, 6.0, respeak="dev", training_rate=True)])

    with pytest.raises(RuntimeError, match="generate dev first"):
        D.generate(tmp_path, cfg(), ["dev_again"])
    df = pl.read_parquet(D.generate(tmp_path, cfg()))
    src, twin = (df.filter(pl.col("split") == s).sort("id") for s in ("dev", "dev_again"))
    assert twin["words"].to_list() == src["words"].to_list()
    assert twin["text"].to_list() == src["text"].to_list()
    # training voices and rates are their own nearest training condition
    assert twin["voice"].to_list() == src["voice"].to_list()
    assert twin["rate"].to_list() == src["rate"].to_list()
    capsys.readouterr()
    D.generate(tmp_path, cfg())
    assert "dev_again: complete with the same seed and spec, kept" in capsys.readouterr().err
    # a new source: the twin is made again from it
    df1 = pl.read_parquet(D.generate(tmp_path, cfg(seed=1)))
    assert "dev_again: complete" not in capsys.readouterr().err
    src1, twin1 = (df1.filter(pl.col("split") == s).sort("id") for s in ("dev", "dev_again"))
    assert twin1["text"].to_list() == src1["text"].to_list() != src["text"].to_list()


def test_generated_twins_read_test_new_word_for_word():
    """On a generated corpus (``KVSIM_MINIVOX_DATA``): each twin's clip i has test_new clip
    i's words, and the voice and rate its conditions say."""
    import polars as pl

    root = Path(os.environ.get("KVSIM_MINIVOX_DATA", "data/minivox"))
    if not (root / "manifest.parquet").is_file():
        pytest.skip(f"{root}: no minivox corpus (set KVSIM_MINIVOX_DATA)")
    df = pl.read_parquet(root / "manifest.parquet")
    src = df.filter(pl.col("split") == "test_new").sort("id").to_dicts()
    for spec in (s for s in D.DataConfig().splits if s.respeak):
        twin = df.filter(pl.col("split") == spec.name).sort("id").to_dicts()
        if not twin:
            continue
        assert len(twin) == len(src)
        for a, b in zip(src, twin, strict=True):
            assert b["words"] == a["words"] and b["text"] == a["text"]
            voice, (lo, hi) = R.respeak_condition(
                a["voice"], a["rate"], train_rates=D.TRAIN_RATES,
                training_voice=spec.training_voice, training_rate=spec.training_rate)
            assert b["voice"] == voice and lo <= b["rate"] <= hi
            assert b["word_end"][-1] <= b["duration"]
