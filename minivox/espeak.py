"""Offline English speech synthesis with exact word timings through libespeak-ng (ctypes).

Word events (type 1) give each word's text span; phoneme events (type 7) give audio
positions. Word events arrive 10-50 ms early, so a word starts at its first non-pause
phoneme and ends where the event after its last non-pause phoneme begins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
from dataclasses import dataclass

import numpy as np
from scipy.signal import resample_poly

_EV_WORD = 1
_PUNCT = "\"()[]{},.;:!?-`*"
_EV_PHONEME = 7
_EV_END = 5
_EV_MSG_TERMINATED = 6
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INIT_PHONEME_EVENTS = 0x0001
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_RATE, _PITCH, _RANGE, _WORDGAP = 1, 3, 4, 7
_PHONEME_SPACES = ord(" ") << 8  # espeak_TextToPhonemes: phonemes separated by spaces


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                             ctypes.POINTER(_Event))


@dataclass
class Synthesis:
    """One synthesised utterance at 16 kHz with word timings in seconds."""

    audio: np.ndarray  # float32, 16 kHz mono
    words: list[str]
    starts: list[float]
    ends: list[float]


ESPEAK_MISSING = "libespeak-ng not found: install the Debian packages espeak-ng libespeak-ng1"


def load_library() -> ctypes.CDLL:
    """libespeak-ng, or RuntimeError(:data:`ESPEAK_MISSING`)."""
    name = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError as exc:
        raise RuntimeError(ESPEAK_MISSING) from exc


def espeak_version() -> str:
    """libespeak-ng's version (``espeak_Info``), e.g. ``"1.51"``: its voices and rules, hence
    the audio of every clip, change with it."""
    lib = load_library()
    lib.espeak_Info.restype = ctypes.c_char_p
    lib.espeak_Info.argtypes = [ctypes.c_void_p]
    return lib.espeak_Info(None).decode()


class ESpeak:
    """A single-process handle on libespeak-ng (the library is global state: one per process)."""

    _lock = threading.Lock()

    def __init__(self) -> None:
        self.lib = load_library()
        sr = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None, _INIT_PHONEME_EVENTS)
        if sr <= 0:
            raise RuntimeError("espeak_Initialize failed")
        self.sample_rate = int(sr)
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, int, int, int, bytes]] = []
        self._cb = _CALLBACK(self._callback)
        self.lib.espeak_SetSynthCallback(self._cb)
        self._to_phonemes = self.lib.espeak_TextToPhonemes
        self._to_phonemes.restype = ctypes.c_char_p
        self._to_phonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                      ctypes.c_int]

    def _callback(self, wav, n, events) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        i = 0
        while True:
            ev = events[i]
            if ev.type == 0:
                break
            s = bytes(ev.id.string) if ev.type == _EV_PHONEME else b""
            self._events.append((ev.type, ev.text_position, ev.length, ev.audio_position, s))
            i += 1
        return 0

    def synth(self, text: str, voice: str = "en-us", rate: int = 160, pitch: int = 50,
              word_gap: int = 0, time_joined: bool = False) -> Synthesis:
        """Synthesise ``text``; returns 16 kHz float audio and per-word timings.

        Parameters
        ----------
        text : str
            Plain ASCII English text.
        voice : str
            espeak-ng voice name, optionally with a variant (``"en-us+f2"``).
        rate : int
            Words per minute.
        pitch : int
            Base pitch 0-100.
        word_gap : int
            Extra pause between words in units of 10 ms.
        time_joined : bool
            Time the words espeak-ng speaks joined to the word before, which get no word
            event of their own (about one sentence in three has one, mostly "the" and "a"),
            by splitting the joined phonemes at each word's phoneme count spoken alone
            (:func:`split_points`). False leaves them out of ``words``.
        """
        with self._lock:
            if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise ValueError(f"espeak-ng voice {voice!r} not available")
            self.lib.espeak_SetParameter(_RATE, int(rate), 0)
            self.lib.espeak_SetParameter(_PITCH, int(pitch), 0)
            self.lib.espeak_SetParameter(_WORDGAP, int(word_gap), 0)
            self._chunks, self._events = [], []
            raw = text.encode("utf-8")
            buf = ctypes.create_string_buffer(raw)
            err = self.lib.espeak_Synth(buf, len(raw) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8,
                                        None, None)
            if err != 0:
                raise RuntimeError(f"espeak_Synth failed with code {err}")
            self.lib.espeak_Synchronize()
            pcm = (np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16))
            events = list(self._events)
            counts = self.phoneme_counts(text) if time_joined else None
        audio = resample_poly(pcm.astype(np.float32) / 32768.0, 320, 441).astype(np.float32)
        words, starts, ends = _word_times(text, events, len(audio) / 16000.0, counts)
        return Synthesis(audio=audio, words=words, starts=starts, ends=ends)

    def phoneme_counts(self, text: str) -> list[int]:
        """Each of :func:`text_tokens`' words' number of phonemes spoken alone in the current
        voice (``espeak_TextToPhonemes``, phonemes separated by spaces); 0 for punctuation."""
        convert, counts = self._to_phonemes, []
        for _, word in text_tokens(text.encode("utf-8")):
            word = word.encode("utf-8")
            buf = ctypes.create_string_buffer(word)
            ptr = ctypes.c_void_p(ctypes.addressof(buf))
            n = 0
            while word and ptr.value:  # one clause per call; the pointer ends as NULL
                n += len((convert(ctypes.byref(ptr), _CHARS_UTF8, _PHONEME_SPACES) or b"").split())
            counts.append(n)
        return counts


def _is_pause(ph: bytes) -> bool:
    p = ph.rstrip(b"\x00")
    return p == b"" or p.startswith(b"_")


def text_tokens(raw: bytes) -> list[tuple[tuple[int, int], str]]:
    """The whitespace tokens of ``raw`` (UTF-8): each token's byte span and its word,
    punctuation stripped (empty for a token of punctuation only)."""
    return [((m.start(), m.end()), m.group().decode("utf-8", "replace").strip(_PUNCT))
            for m in re.finditer(rb"\S+", raw)]


def _event_groups(tokens: list[tuple[int, int]], events,
                  total: float) -> list[tuple[int, list[float], float]]:
    """Each word event's text token, its non-pause phonemes' onsets and its end (seconds).

    A word starts at its first non-pause phoneme and ends where the event after its last
    one begins; an event without phonemes is a point at its own audio position."""
    widx = [i for i, e in enumerate(events) if e[0] == _EV_WORD]
    groups = []
    for k, i in enumerate(widx):
        pos = events[i][1]
        tok = next((t for t, (a, b) in enumerate(tokens) if a <= pos - 1 < b), None)
        if tok is None:
            continue
        stop = widx[k + 1] if k + 1 < len(widx) else len(events)
        phon = [(j, e) for j, e in enumerate(events[i + 1 : stop], start=i + 1)
                if e[0] == _EV_PHONEME and not _is_pause(e[4])]
        if phon:
            onsets = [min(e[3] / 1000.0, total) for _, e in phon]
            nxt = [e[3] for e in events[phon[-1][0] + 1 :]
                   if e[0] in (_EV_PHONEME, _EV_WORD, _EV_END, _EV_MSG_TERMINATED)]
            end = (nxt[0] / 1000.0) if nxt else total
        else:
            onsets = [min(events[i][3] / 1000.0, total)]
            end = onsets[0]
        groups.append((tok, onsets, min(max(end, onsets[0]), total)))
    return groups


def split_points(n_phonemes: int, counts: list[int]) -> list[int] | None:
    """Where each word after the first of a joined group begins, as phoneme indices.

    ``counts`` are the words' phoneme counts spoken alone: where they add up to the group's
    ``n_phonemes`` the points are exact; otherwise they are the counts' proportions of the
    group, rounded, each word keeping at least one phoneme. None where the group has fewer
    phonemes than words."""
    n = len(counts)
    if n_phonemes < n:
        return None
    weights = [max(c, 1) for c in counts]
    total, cum, low, points = sum(weights), 0, 1, []
    for j, w in enumerate(weights[:-1], start=1):
        cum += w
        point = min(max(round(n_phonemes * cum / total), low), n_phonemes - (n - j))
        points.append(point)
        low = point + 1
    return points


def _word_times(text: str, events, total: float,
                counts: list[int] | None = None) -> tuple[list[str], list[float], list[float]]:
    """Word strings and [start, end) seconds from espeak word and phoneme events.

    espeak-ng emits no word event for some unstressed words it speaks joined to the word
    before ("was the", "I shall"): their phonemes follow that word's event. With ``counts``
    (each of :func:`text_tokens`' phoneme count spoken alone, :meth:`ESpeak.phoneme_counts`)
    such a group is split among its words at :func:`split_points`; without, the joined words
    are left out of the list (as every split made before 2026-12-06 has them)."""
    pairs = text_tokens(text.encode("utf-8"))
    tokens, token_words = [span for span, _ in pairs], [word for _, word in pairs]
    groups = _event_groups(tokens, events, total)
    words, starts, ends = [], [], []
    last_tok = -1
    for k, (tok, onsets, end) in enumerate(groups):
        if tok == last_tok and words:  # one token split into several espeak words
            ends[-1] = max(ends[-1], end)
            continue
        if not token_words[tok]:
            continue
        last_tok = tok
        nxt = groups[k + 1][0] if k + 1 < len(groups) else len(tokens)
        joined = [t for t in range(tok + 1, nxt) if token_words[t]]
        points = (split_points(len(onsets), [counts[t] for t in [tok, *joined]])
                  if counts is not None and joined else None)
        if points is None:
            joined, points = [], []
        bounds = [onsets[0], *(onsets[p] for p in points), end]
        for j, t in enumerate([tok, *joined]):
            words.append(token_words[t])
            starts.append(bounds[j])
            ends.append(bounds[j + 1])
    return words, starts, ends
