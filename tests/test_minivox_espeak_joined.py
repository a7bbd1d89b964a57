"""Words espeak-ng speaks joined to the word before: timed by phoneme counts, or left out."""

from __future__ import annotations

import random

import pytest

from kvsim.minivox.espeak import _EV_PHONEME, _EV_WORD, _word_times, split_points

TEXT = "It was the best."


def _events() -> list[tuple[int, int, int, int, bytes]]:
    """espeak-ng's events for TEXT as 1.51 emits them: no word event for "the", whose
    phonemes (D @2) follow those of "was" (positions 1-based, times in ms)."""
    ev = []

    def word(pos, length, ms, phonemes):
        ev.append((_EV_WORD, pos, length, ms, b""))
        for name, at in phonemes:
            ev.append((_EV_PHONEME, pos, 0, at, name))

    word(1, 2, 0, [(b"I", 0), (b"t", 100)])
    word(4, 3, 150, [(b"w", 150), (b"V", 230), (b"z", 280), (b"D", 350), (b"@2", 400)])
    word(12, 4, 450, [(b"b", 450), (b"E", 530), (b"s", 650), (b"t", 750), (b"_:", 800)])
    return ev


def test_split_points_are_the_counts_where_they_add_up():
    assert split_points(5, [3, 2]) == [3]
    assert split_points(6, [1, 3, 2]) == [1, 4]


def test_split_points_are_proportions_otherwise_each_word_keeping_a_phoneme():
    assert split_points(10, [3, 2]) == [6]  # 10 * 3/5
    assert split_points(9, [3, 4]) == [4]  # 9 * 3/7 = 3.86 rounds up
    assert split_points(4, [5, 1, 1]) == [2, 3]  # 4 * 5/7 rounds to 3, but two words follow
    assert split_points(3, [0, 0, 0]) == [1, 2]  # a count of 0 weighs as 1
    assert split_points(2, [1, 1, 1]) is None


def test_joined_word_is_timed_at_its_first_phoneme():
    words, starts, ends = _word_times(TEXT, _events(), 1.0, counts=[2, 3, 2, 4])
    assert words == ["It", "was", "the", "best"]
    assert starts == [0.0, 0.15, 0.35, 0.45]
    assert ends == [0.15, 0.35, 0.45, 0.8]


def test_joined_word_is_left_out_without_counts():
    """The splits made before 2026-12-06: the group is "was" alone, from w to the end of @2."""
    words, starts, ends = _word_times(TEXT, _events(), 1.0)
    assert words == ["It", "was", "best"]
    assert starts[1] == 0.15 and ends[1] == 0.45


def test_counts_that_do_not_add_up_split_by_proportion():
    # "was" alone counted 1, "the" 4: 5 phonemes * 1/5 -> "the" from the second (V)
    words, starts, _ = _word_times(TEXT, _events(), 1.0, counts=[2, 1, 4, 4])
    assert words[2] == "the" and starts[2] == 0.23


def _espeak():
    from kvsim.minivox.espeak import ESpeak

    try:
        return ESpeak()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def test_real_espeak_times_every_word_of_a_sentence_with_joined_words():
    tts = _espeak()
    text = "It was the best of times, it was the worst of times."
    plain = tts.synth(text)
    timed = tts.synth(text, time_joined=True)
    spoken = [w.strip(",.") for w in text.split()]
    assert len(plain.words) < len(spoken)  # espeak joins "the" to "was"
    assert timed.words == spoken
    dur = timed.audio.size / 16000
    assert all(0 <= s <= e <= dur for s, e in zip(timed.starts, timed.ends, strict=True))
    assert all(a <= b for a, b in zip(timed.starts, timed.starts[1:], strict=False))
    # the joined word starts where the word before it ends, at one of that group's phonemes
    onsets = {e[3] / 1000 for e in tts._events if e[0] == _EV_PHONEME}
    i = timed.words.index("the")
    assert timed.ends[i - 1] == timed.starts[i] and timed.starts[i] in onsets
    assert timed.starts[i - 1] < timed.starts[i] < timed.ends[i]


class _RecordingTTS:
    """Records what make_clip asked for; speaks every text as one second of noise."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    def synth(self, text, voice="en-us", rate=160, pitch=50, time_joined=False):
        import numpy as np

        from kvsim.minivox.espeak import Synthesis

        self.asked.append(time_joined)
        words = [w.strip(".") for w in text.split()]
        n = len(words)
        audio = np.random.default_rng(0).uniform(-0.1, 0.1, 16000).astype(np.float32)
        return Synthesis(audio, words, [i / n for i in range(n)], [(i + 1) / n for i in range(n)])


@pytest.mark.parametrize("timed", [False, True])
def test_make_clip_asks_for_joined_words_as_its_split_says(timed):
    from kvsim.minivox.data import make_clip

    tts = _RecordingTTS()
    make_clip(tts, ["One two three."], 0, random.Random(0), 0.5, 1.8, time_joined_words=timed)
    assert tts.asked and set(tts.asked) == {timed}


def test_only_splits_that_time_joined_words_record_it():
    from dataclasses import replace

    from kvsim.minivox.data import DataConfig, split_record

    dev = next(s for s in DataConfig().splits if s.name == "dev")
    assert "time_joined_words" not in split_record(DataConfig(), dev, {}, "1.51")["spec"]
    timed = split_record(DataConfig(), replace(dev, time_joined_words=True), {}, "1.51")
    assert timed["spec"]["time_joined_words"] is True


def test_phoneme_counts_follow_the_text_tokens():
    """One count per whitespace token (as ``_word_times`` indexes them), punctuation 0."""
    tts = _espeak()
    counts = tts.phoneme_counts("It was -- the best.")
    assert len(counts) == 5 and counts[2] == 0
    assert counts[1] == 3 and all(c > 0 for i, c in enumerate(counts) if i != 2)  # w V z
