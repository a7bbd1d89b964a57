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
              word_gap: int = 0) -> Synthesis:
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
        audio = resample_poly(pcm.astype(np.float32) / 32768.0, 320, 441).astype(np.float32)
        words, starts, ends = _word_times(text, events, len(audio) / 16000.0)
        return Synthesis(audio=audio, words=words, starts=starts, ends=ends)


def _is_pause(ph: bytes) -> bool:
    p = ph.rstrip(b"\x00")
    return p == b"" or p.startswith(b"_")


def _word_times(text: str, events, total: float) -> tuple[list[str], list[float], list[float]]:
    """Word strings and [start, end) seconds from espeak word and phoneme events."""
    raw = text.encode("utf-8")
    # Indices of word events in the event stream.
    widx = [i for i, e in enumerate(events) if e[0] == _EV_WORD]
    words, starts, ends = [], [], []
    tokens = [(m.start(), m.end()) for m in re.finditer(rb"\S+", raw)]
    last_tok = -1
    for k, i in enumerate(widx):
        _, pos, length, apos, _ = events[i]
        tok = next((t for t, (a, b) in enumerate(tokens) if a <= pos - 1 < b), None)
        if tok is None:
            continue
        a, b = tokens[tok]
        word = raw[a:b].decode("utf-8", "replace").strip(_PUNCT)
        stop = widx[k + 1] if k + 1 < len(widx) else len(events)
        phon = [(j, e) for j, e in enumerate(events[i + 1 : stop], start=i + 1)
                if e[0] == _EV_PHONEME and not _is_pause(e[4])]
        if phon:
            start = phon[0][1][3] / 1000.0
            last = phon[-1][0]
            nxt = [e[3] for e in events[last + 1 :] if e[0] in (_EV_PHONEME, _EV_WORD, _EV_END,
                                                               _EV_MSG_TERMINATED)]
            end = (nxt[0] / 1000.0) if nxt else total
        else:
            start = apos / 1000.0
            end = start
        start, end = min(start, total), min(max(end, start), total)
        if tok == last_tok and words:  # one token split into several espeak words
            ends[-1] = max(ends[-1], end)
            continue
        if not word:
            continue
        last_tok = tok
        words.append(word)
        starts.append(start)
        ends.append(end)
    return words, starts, ends
