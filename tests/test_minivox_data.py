"""minivox data: text cleaning, split disjointness, espeak timings, WER normalisation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvsim.minivox.data import DataConfig, clean_fortune, split_texts
from kvsim.wer import WerConfig, corpus_wer, normalize


def test_clean_fortune_drops_attribution_and_bad_text():
    raw = 'A banker is a fellow who lends you\nhis umbrella.\n\t\t-- Mark Twain, "Essays"'
    assert clean_fortune(raw) == "A banker is a fellow who lends you his umbrella."
    assert clean_fortune("It happened in 1984 as told.") is None  # digits
    assert clean_fortune("Too short") is None
    assert clean_fortune("Caf\u00e9 society is not for everyone at all.") is None
    assert clean_fortune("He said -- twice -- no") == "He said, twice, no."


def test_splits_never_share_text():
    texts = [f"sentence number {w} is here now" for w in
             (["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"] * 30)]
    texts = list(dict.fromkeys(t + f" {i}x" for i, t in enumerate(texts)))
    parts = split_texts(texts, DataConfig(seed=3))
    seen: dict[str, str] = {}
    for name, items in parts.items():
        for t in items:
            assert t not in seen, f"{t!r} in {seen.get(t)} and {name}"
            seen[t] = name
    assert sum(len(v) for v in parts.values()) == len(texts)
    assert split_texts(texts, DataConfig(seed=3)) == parts
    assert split_texts(texts, DataConfig(seed=4)) != parts


def _tts():
    if not Path("/usr/lib/x86_64-linux-gnu/libespeak-ng.so.1").exists():
        import ctypes.util

        if ctypes.util.find_library("espeak-ng") is None:
            pytest.skip("libespeak-ng not installed")
    from kvsim.minivox.espeak import ESpeak

    return ESpeak()


def test_espeak_word_times_are_ordered_and_inside_audio():
    tts = _tts()
    text = "Don't panic, the quick brown fox jumps over the lazy dog."
    syn = tts.synth(text, voice="en-us+f2", rate=170)
    dur = syn.audio.size / 16000
    assert syn.words == [w.strip(",.") for w in text.split()]
    assert all(0 <= s <= e <= dur for s, e in zip(syn.starts, syn.ends, strict=True))
    assert all(a <= b for a, b in zip(syn.starts, syn.starts[1:], strict=False))
    # Onsets are where the signal is: energy in the first 50 ms of a word beats the
    # leading silence.
    i = int(syn.starts[1] * 16000)
    assert np.abs(syn.audio[i : i + 800]).mean() > 5 * np.abs(syn.audio[:100]).mean() + 1e-6


_CLIP_SCRIPT = """
import hashlib, json, random
from kvsim.minivox.espeak import ESpeak
from kvsim.minivox.data import make_clip
pool = ["The cat sat on the mat today.", "A stitch in time saves nine more.",
        "All that glitters is not gold, they say."]
clip, cur = make_clip(ESpeak(), pool, 0, random.Random(7), 3.0, 9.0)
print(json.dumps({"sha": hashlib.sha256(clip["audio"].tobytes()).hexdigest(), "cursor": cur,
                  "text": clip["text"], "n": int(clip["audio"].size), "words": clip["words"],
                  "end": clip["word_end"][-1]}))
"""


def test_make_clip_is_deterministic_across_processes_and_within_bounds():
    """libespeak-ng carries state between calls inside a process, so the corpus is
    deterministic per command run: the same call sequence in a fresh process gives the same
    bytes."""
    import json
    import subprocess
    import sys

    _tts()
    root = Path(__file__).resolve().parents[1]
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CLIP_SCRIPT], cwd=root,
                                      capture_output=True, text=True, check=True,
                                      timeout=600).stdout) for _ in range(2)]
    assert runs[0] == runs[1]
    a = runs[0]
    dur = a["n"] / 16000
    assert 3.0 <= dur <= 9.0 + 0.6
    assert len(a["words"]) == len(a["text"].split())
    assert a["end"] <= dur


def test_minivox_scores_with_the_one_truncated_wer():
    """minivox's training and evaluation score with kvsim.wer (WnW §3.5), not a copy."""
    import kvsim.minivox.align as align
    import kvsim.minivox.evaluate as evaluate
    import kvsim.minivox.train as train
    from kvsim import wer

    assert evaluate.corpus_wer is wer.corpus_wer
    assert train.corpus_wer is wer.corpus_wer
    assert align.corpus_wer is wer.corpus_wer
    assert normalize("Hello, World! It's 5 p.m.") == "hello world it's 5 p.m."
    word = WerConfig(unit="word")
    assert corpus_wer(["the cat, sat."], ["The cat sat."], cfg=word) == 0.0
    # Periods are kept (WnW §3.5), so a missing final period is one substitution.
    assert corpus_wer(["the cat sat"], ["The cat sat."], cfg=word) == 1 / 3
    # A runaway hypothesis is truncated to 1.2x the reference: 10 ref words -> 12 hyp words.
    ref = " ".join(["w"] * 10)
    assert corpus_wer([ref + " x" * 100], [ref], cfg=word) == 2 / 10


def test_growing_a_split_keeps_its_earlier_clips(tmp_path):
    """A split's clip i depends only on (seed, split, i) and the clips before it, so a split
    grown from n to n + 1 clips (``test_long``: 8 -> 32) keeps its first n bit for bit."""
    import polars as pl
    import soundfile as sf

    from kvsim.minivox.data import FORTUNE_DIR, SplitSpec, generate

    _tts()
    if not FORTUNE_DIR.is_dir():
        pytest.skip(f"{FORTUNE_DIR} not installed")
    frames = {}
    for n in (2, 3):
        cfg = DataConfig(splits=[SplitSpec("dev", n, 3.0, 6.0)])
        frames[n] = pl.read_parquet(generate(tmp_path / str(n), cfg))
    assert frames[3].height == 3
    assert frames[3].head(2).equals(frames[2])
    for rel in frames[2]["audio_path"]:
        assert np.array_equal(sf.read(tmp_path / "2" / rel)[0], sf.read(tmp_path / "3" / rel)[0])
    assert frames[3]["text"][2] not in set(frames[2]["text"])


def test_clip_ranges_parse_or_fail_in_one_line():
    import argparse

    from kvsim.minivox.data import parse_clips

    assert parse_clips("8:16") == slice(8, 16)
    for bad in ("3", "a:b", "5:5", "-1:4"):
        with pytest.raises(argparse.ArgumentTypeError, match="LO"):
            parse_clips(bad)


def test_clip_voice_and_rates_cycles_bands_with_and_without_fixed_voices():
    from kvsim.minivox.data import TRAIN_RATES, SplitSpec, clip_voice_and_rates

    plain = SplitSpec("x", 4, 8.0, 29.0)
    assert [clip_voice_and_rates(plain, i) for i in range(3)] == [(None, TRAIN_RATES)] * 3
    banded = SplitSpec("x", 4, 8.0, 29.0, rate_bands=((1, 2), (3, 4)))
    assert [clip_voice_and_rates(banded, i) for i in range(4)] == [
        (None, (1, 2)), (None, (3, 4)), (None, (1, 2)), (None, (3, 4))]
    voiced = SplitSpec("x", 4, 8.0, 29.0, voices=("a", "b"), rate_bands=((1, 2), (3, 4)))
    assert [clip_voice_and_rates(voiced, i) for i in range(5)] == [
        ("a", (1, 2)), ("b", (1, 2)), ("a", (3, 4)), ("b", (3, 4)), ("a", (1, 2))]


def test_fast_longform_split_is_fast_and_keeps_test_new_rates_held_out():
    from kvsim.minivox.data import FAST_LONGFORM_RATES, TRAIN_RATES

    splits = {s.name: s for s in DataConfig().splits}
    fast = splits["train_longform_fast"]
    assert fast.rate_bands == (FAST_LONGFORM_RATES,) and fast.voices is None
    assert TRAIN_RATES[0] < FAST_LONGFORM_RATES[0] < TRAIN_RATES[1] < FAST_LONGFORM_RATES[1]
    # every rate any training split speaks at lies outside test_new's bands
    trained = [b for s in splits.values() if s.name != "test_new" for b in (s.rate_bands or (TRAIN_RATES,))]
    for lo, hi in splits["test_new"].rate_bands:
        assert all(hi < a or lo > b for a, b in trained), (lo, hi)
    # it reads the extra pool after train_longform, which starts at its middle
    assert fast.pool == "extra" and fast.start > splits["train_longform"].start


def test_longform_pool_windows_do_not_overlap():
    """train_wide, train_longform, train_longform_fast and train_longform_2 read disjoint
    windows of the extra pool: each window's words (clips x mean duration x top rate) fit before the next start."""
    from kvsim.minivox.data import FAST_LONGFORM_RATES, TRAIN_RATES, WIDE_RATE_BANDS

    pool_words = 1_376_005  # the extra pool's size (load_extra_texts on the Debian packages)
    splits = {s.name: s for s in DataConfig().splits}

    def end(name, top_rate):
        s = splits[name]
        words = s.n_clips * (s.min_s + s.max_s) / 2 / 60 * top_rate
        return s.start + words / pool_words

    assert end("train_wide", TRAIN_RATES[1]) < splits["train_longform"].start
    assert end("train_longform", TRAIN_RATES[1]) < splits["train_longform_fast"].start
    assert end("train_longform_fast", FAST_LONGFORM_RATES[1]) < splits["train_longform_2"].start
    assert end("train_longform_2", TRAIN_RATES[1]) < splits["train_longform_voices"].start
    assert splits["train_longform_voices_c"].start == splits["train_longform_voices"].start
    assert end("train_longform_voices", WIDE_RATE_BANDS[-1][1]) < 1.0


def test_wide_voices_are_new_speakers_of_trained_accents_and_keep_test_new_held_out():
    """train_longform_voices speaks variants neither training nor test_new uses, in the
    accents training has, at rates beyond training's on both sides and outside test_new's;
    its control is the same stretch of text in training's voices and rates."""
    from kvsim.minivox.data import (
        HELDOUT_RATE_BANDS,
        HELDOUT_VOICES,
        TRAIN_RATES,
        VOICES,
        WIDE_RATE_BANDS,
        WIDE_VOICES,
    )

    def variant(v):
        return v.partition("+")[2]

    splits = {s.name: s for s in DataConfig().splits}
    wide, control = splits["train_longform_voices"], splits["train_longform_voices_c"]
    assert wide.voices == WIDE_VOICES and wide.rate_bands == WIDE_RATE_BANDS
    assert len(set(WIDE_VOICES)) == len(WIDE_VOICES) == 16
    assert {variant(v) for v in WIDE_VOICES}.isdisjoint(
        {variant(v) for v in VOICES + list(HELDOUT_VOICES)} - {""})
    assert {v.partition("+")[0] for v in WIDE_VOICES} == {v.partition("+")[0] for v in VOICES}
    (slow_lo, slow_hi), middle, (fast_lo, fast_hi) = WIDE_RATE_BANDS
    assert middle == TRAIN_RATES and slow_hi < TRAIN_RATES[0] and fast_lo > TRAIN_RATES[1]
    for lo, hi in HELDOUT_RATE_BANDS:
        assert all(hi < a or lo > b for a, b in WIDE_RATE_BANDS), (lo, hi)
    # every voice speaks in every band
    assert wide.n_clips == len(WIDE_VOICES) * len(WIDE_RATE_BANDS)
    assert (control.voices, control.rate_bands, control.pool, control.n_clips) == (
        None, None, wide.pool, wide.n_clips)


def test_a_complete_split_with_the_same_record_is_kept_and_any_change_regenerates(
        tmp_path, capsys, monkeypatch):
    """Re-running the generator keeps a split that is complete with the same seed and spec
    (the recipe re-runs its data step on every start) and synthesises it again when the seed,
    the spec or an audio file changed, when its record is missing (an interrupted run, or a
    corpus from before records), or when forced."""
    import polars as pl

    from kvsim.minivox.data import FORTUNE_DIR, SplitSpec, generate, record_path

    _tts()
    if not FORTUNE_DIR.is_dir():
        pytest.skip(f"{FORTUNE_DIR} not installed")

    def run(seed=0, n=2, force=False):
        cfg = DataConfig(seed=seed, splits=[SplitSpec("dev", n, 3.0, 5.0)])
        capsys.readouterr()
        df = pl.read_parquet(generate(tmp_path, cfg, force=force))
        kept = "dev: complete with the same seed and spec, kept" in capsys.readouterr().err
        return kept, df

    first = tmp_path / "audio" / "dev" / "dev-00000.flac"
    kept, df0 = run()
    assert not kept and record_path(tmp_path, "dev").is_file()
    stamp = first.stat().st_mtime_ns
    kept, df = run()
    assert kept and df.equals(df0) and first.stat().st_mtime_ns == stamp
    assert not run(force=True)[0]
    kept, df1 = run(seed=1)
    assert not kept and df1["text"][0] != df0["text"][0]
    assert not run(seed=1, n=3)[0]
    first.unlink()
    assert not run(seed=1, n=3)[0] and first.is_file()
    record_path(tmp_path, "dev").unlink()
    assert not run(seed=1, n=3)[0]
    assert run(seed=1, n=3)[0]
    # an upgraded text package: other source digests, the split made again
    import kvsim.minivox.data as data

    real = data.source_digests
    monkeypatch.setattr(data, "source_digests", lambda spec: {**real(spec), "fortunes": "x"})
    assert not run(seed=1, n=3)[0]
    monkeypatch.setattr(data, "source_digests", real)  # the record holds "x": made again
    assert not run(seed=1, n=3)[0] and run(seed=1, n=3)[0]
    # another libespeak-ng: other audio, the split made again
    import kvsim.minivox.espeak as espeak

    monkeypatch.setattr(espeak, "espeak_version", lambda: "0.0-other")
    assert not run(seed=1, n=3)[0]


def test_source_digests_follow_the_bytes_of_the_files_each_pool_reads(tmp_path):
    from kvsim.minivox.data import SplitSpec, source_digests
    from kvsim.minivox.extra_text import WORDNET_FILES

    fortunes, wordnet = tmp_path / "fortunes", tmp_path / "wordnet"
    fortunes.mkdir()
    wordnet.mkdir()
    (fortunes / "art").write_text("a\n%\nb\n")
    (fortunes / "art.dat").write_bytes(b"\x00\x01")
    for name in WORDNET_FILES:
        (wordnet / name).write_text(name)
    plain, extra = SplitSpec("dev", 2, 3.0, 5.0), SplitSpec("w", 2, 3.0, 5.0, pool="extra")
    first = {s.name: source_digests(s, fortunes, wordnet) for s in (plain, extra)}
    assert set(first["dev"]) == {"fortunes"} and set(first["w"]) == {"fortunes", "wordnet"}
    (wordnet / WORDNET_FILES[-1]).write_text("changed")
    assert source_digests(plain, fortunes, wordnet) == first["dev"]
    assert source_digests(extra, fortunes, wordnet)["wordnet"] != first["w"]["wordnet"]
    (fortunes / "art.dat").write_bytes(b"\x00\x02")
    assert source_digests(plain, fortunes, wordnet)["fortunes"] != first["dev"]["fortunes"]


class _ScriptedTTS:
    """A stand-in for ESpeak whose word events are given per text: 1 s of noise per text."""

    def __init__(self, events: dict[str, list[str]]):
        self.events = events

    def synth(self, text, voice="en-us", rate=160, pitch=50, time_joined=False):
        from kvsim.minivox.espeak import Synthesis

        words = self.events[text]
        n = len(words)
        audio = np.random.default_rng(0).uniform(-0.1, 0.1, 16000).astype(np.float32)
        return Synthesis(audio=audio, words=words, starts=[i / n for i in range(n)],
                         ends=[(i + 1) / n for i in range(n)])


def test_exact_words_skips_a_text_whose_espeak_words_only_count_the_same():
    """A joined word and a split token can cancel out (9 clips of the corpus): counting the
    words keeps such a text with its words one off; comparing them skips it."""
    import random

    from kvsim.minivox.data import make_clip, words_agree

    off = "Dinah was the cat. I hope."
    good = "Alice had no idea at all."
    tts = _ScriptedTTS({off: ["Dinah", "was", "cat", "I", "ho", "pe"],
                        good: ["Alice", "had", "no", "idea", "at", "all"]})
    assert words_agree(tts.events[off], off, exact=False)
    assert not words_agree(tts.events[off], off, exact=True)
    assert words_agree(tts.events[good], good, exact=True)
    clip, _ = make_clip(tts, [off, good], 0, random.Random(0), 0.5, 1.8)
    assert clip["text"] == off and clip["words"] == tts.events[off]  # the legacy check
    clip, cursor = make_clip(tts, [off, good], 0, random.Random(0), 0.5, 1.8, exact_words=True)
    assert clip["text"] == good and cursor == 2
    assert clip["words"] == [w.strip(".") for w in good.split()]


def test_only_splits_made_with_the_exact_check_record_it():
    from kvsim.minivox.data import split_record

    splits = {s.name: s for s in DataConfig().splits}
    book = split_record(DataConfig(), splits["train_longform_book"], {}, "1.51")
    assert book["spec"]["exact_words"] is True
    checked = {s.name for s in DataConfig().splits if s.exact_words}
    assert checked == {"train_longform_book", "train_longform_novels",
                       "train_longform_novels_2"}  # made after the check
    assert "exact_words" not in split_record(DataConfig(), splits["dev"], {}, "1.51")["spec"]
