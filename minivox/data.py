"""Deterministic synthetic English speech corpus for minivox.

Text: the fortune-cookie databases of the Debian packages ``fortunes`` / ``fortunes-min``
(thousands of quotations, jokes, literature and science excerpts by many authors). Each
fortune is cleaned (ASCII, no digits or markup, attributions dropped) and deduplicated; whole
fortunes are assigned to exactly one split by a seeded shuffle, so splits never share text.
The ``train_wide`` split adds distinct training-only text from WordNet and the ``anarchism``
fortunes (:mod:`kvsim.minivox.extra_text`; Debian packages ``wordnet-base``,
``fortune-anarchism``), none of it inside a held-out text; ``train_longform_book`` reads one
novel in order (:mod:`kvsim.minivox.book_text`, from the brotli sdist),
``train_longform_novels`` four (:mod:`kvsim.minivox.novel_text`, from a Debian package's R
data). The ``test_new``
split reads a source and register no training split uses (report prose from the brotli
sdist, :mod:`kvsim.minivox.heldout_text`), with voices and speaking rates held out of
training; its three re-spoken twins (``test_new_train_voice``, ``_train_rate``,
``_train_both``) read its words again with the voice, the rate or both moved to the nearest
training condition (:mod:`kvsim.minivox.respeak`).

Speech: libespeak-ng (see :mod:`kvsim.minivox.espeak`) with several voices, speaking
rates and pitches; a clip concatenates consecutive fortunes of its split with natural
pauses (0.25-0.9 s) between them; word timings come from espeak's phoneme events.

Usage::

    python -m kvsim.minivox.data --out data/minivox --seed 0

writes ``<out>/audio/<split>/<id>.flac`` (16 kHz mono) and ``<out>/manifest.parquet`` with
columns ``id, split, audio_path (relative to out), duration, text, words, word_start,
word_end, voice, rate``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from kvsim.trace.atomic import atomic_file

from .book_text import load_book_pool, read_book
from .clip_audio import SAMPLE_RATE, ClipAssembly
from .extra_text import (
    EXTRA_FORTUNE_FILES,
    WORDNET_DIR,
    WORDNET_FILES,
    load_extra_texts,
    missing_sources,
)
from .heldout_text import load_heldout_pool, prose_sentences, read_source
from .novel_text import load_novel_pool, rdata_problem, read_rda

FORTUNE_DIR = Path("/usr/share/games/fortunes")
# Voices x variants available in espeak-ng's standard data (no mbrola needed).
VOICES = [
    "en-us", "en-us+f2", "en-us+m3", "en-us+f4", "en", "en+f3", "en-gb-x-rp",
    "en-gb-x-rp+m2", "en-029", "en-gb-scotland+f1", "en-us-nyc", "en-gb-x-gbclan", "en-gb-x-gbcwmd",
]
TRAIN_RATES = (135, 195)  # words/min, inclusive: every split but test_new and train_longform_fast
# train_longform_fast: fast long-form speech (test_long's clips at >= 180 words/min lose the most
# words, docs/minivox.md "Next steps"), below test_new's fast band so that band stays held out
FAST_LONGFORM_RATES = (180, 199)
# test_new: base voices with variants no training voice uses (training: f1-f4, m2, m3), and
# speaking rates outside TRAIN_RATES; clip i gets voice i % 6 and band (i // 6) % 2, so every
# voice speaks once slowly and once fast.
HELDOUT_VOICES = ("en-us+m1", "en-gb-x-rp+m4", "en+m6", "en-us-nyc+f5", "en-029+m7",
                  "en-gb-scotland+m5")
HELDOUT_RATE_BANDS = ((115, 130), (200, 215))
# train_longform_voices: more speakers and rates than training has, none of test_new's: the
# accents of VOICES with variants no other split uses (neither training's f1-f4, m2, m3 nor
# test_new's m1, m4-m7, f5), and rates beyond both ends of TRAIN_RATES that skip test_new's
# bands; clip i gets voice i % 16 and band (i // 16) % 3. Its control, train_longform_voices_c,
# reads the same stretch of text in training's voices and rates.
WIDE_VOICES = (
    "en-us+m8", "en+Andy", "en-gb-x-rp+Annie", "en-029+Denis", "en-gb-scotland+Gene",
    "en-us-nyc+Lee", "en-gb-x-gbclan+Michael", "en-gb-x-gbcwmd+adam", "en-us+aunty",
    "en+benjamin", "en-gb-x-rp+edward", "en-029+linda", "en-gb-scotland+max", "en-us-nyc+paul",
    "en-gb-x-gbclan+steph", "en-gb-x-gbcwmd+travis",
)
WIDE_RATE_BANDS = ((95, 114), TRAIN_RATES, (216, 235))
SKIP_FILES = {"ascii-art", "art", "perl", "translate-me", "linux", "linuxcookie", "debian",
              "computers", "zippy", "startrek", "knghtbrd"}


@dataclass
class SplitSpec:
    """How many clips of which duration range a split gets."""

    name: str
    n_clips: int
    min_s: float
    max_s: float
    # text pool to draw from: a split's fortunes (default: ``name``), "extra" (training
    # only: WordNet sentences and the anarchism fortunes, see :mod:`.extra_text`), "prose"
    # (held-out report prose in reading order, see :mod:`.heldout_text`), "book"
    # (training only: a novel in reading order, see :mod:`.book_text`) or "novels" (training
    # only: four novels in reading order, see :mod:`.novel_text`)
    pool: str | None = None
    # fixed voices and rate bands (clip i: voices[i % n], band (i // n) % len(bands), see
    # clip_voice_and_rates); None: a random training voice, a rate in TRAIN_RATES
    voices: tuple[str, ...] | None = None
    rate_bands: tuple[tuple[int, int], ...] | None = None
    # where in the (shuffled) pool the first clip starts, as a fraction of the pool: lets two
    # splits draw disjoint text from one pool (a reading-order pool: every clip's passage
    # moves by it, so two splits can interleave)
    start: float = 0.0
    # re-speak this split word for word instead of drawing text (clip i reads its clip i,
    # :mod:`.respeak`), with the training voice of each clip's accent (``training_voice``)
    # and/or a rate in the training band nearest its own (``training_rate``); the source's
    # voice and rate where False. A re-spoken clip lasts as long as its words take at its
    # rate: min_s and max_s bound only drawn splits
    respeak: str | None = None
    training_voice: bool = False
    training_rate: bool = False
    # keep a text only if espeak's words are its words (make_clip's ``exact_words``); False
    # compares their number only, as the splits made before 2026-12-06 did (kept so that they
    # regenerate byte for byte): in 9 of their clips a word espeak joined to a neighbour and
    # a token it split in two cancel out, and the words list runs one word off the text
    exact_words: bool = False
    # time the words espeak speaks joined to the word before (no word event of their own;
    # :meth:`~.espeak.ESpeak.synth`'s ``time_joined``): False rejects every text with one,
    # about a third of the fortunes and WordNet texts and over half of report prose, as
    # every split made before 2026-12-06 did
    time_joined_words: bool = False


@dataclass
class DataConfig:
    """Corpus configuration (defaults = the shipped minivox corpus)."""

    seed: int = 0
    splits: list[SplitSpec] = field(default_factory=lambda: [
        SplitSpec("train", 2400, 8.0, 29.0),
        SplitSpec("train_long", 320, 30.0, 60.0, pool="train"),
        SplitSpec("train_wide", 7200, 8.0, 29.0, pool="extra"),
        # continuous 1-4 min speech of text the model has not been trained on (train_wide's
        # 7,200 clips read the first 24% of the extra pool; this split starts at half of it)
        SplitSpec("train_longform", 400, 60.0, 240.0, pool="extra", start=0.5),
        # the same, spoken fast, of text after train_longform's (which reads about 12% of the
        # pool from its middle on)
        SplitSpec("train_longform_fast", 160, 60.0, 240.0, pool="extra", start=0.7,
                  rate_bands=(FAST_LONGFORM_RATES,)),
        # its control: as many clips at the training rates, of text after the fast split's
        SplitSpec("train_longform_2", 160, 60.0, 240.0, pool="extra", start=0.8),
        # new speakers and rates (WIDE_VOICES, WIDE_RATE_BANDS) and their control: the same
        # stretch of the extra pool, after train_longform_2's, in training's voices and rates
        SplitSpec("train_longform_voices", 48, 60.0, 240.0, pool="extra", start=0.9,
                  voices=WIDE_VOICES, rate_bands=WIDE_RATE_BANDS),
        SplitSpec("train_longform_voices_c", 48, 60.0, 240.0, pool="extra", start=0.9),
        # continuous narrative (one book in reading order) in training's voices and rates:
        # against train_longform_voices_c, the text source alone changes
        SplitSpec("train_longform_book", 48, 60.0, 240.0, pool="book", exact_words=True),
        # four novels (448,000 words) in reading order, every clip distinct text, with the
        # words espeak joins timed: against train_longform_book, the same register at scale
        SplitSpec("train_longform_novels", 48, 60.0, 240.0, pool="novels", exact_words=True,
                  time_joined_words=True),
        # three times as many passages of the same novels, none read by the split above: its
        # clip 3k starts 74 units (about 1,500 words) after that split's clip k, its clip
        # 3k + 2 as far before clip k + 1 (a clip reads 45 units at most, 60 checked)
        SplitSpec("train_longform_novels_2", 144, 60.0, 240.0, pool="novels", start=1 / 288,
                  exact_words=True, time_joined_words=True),
        SplitSpec("dev", 24, 8.0, 29.0),
        SplitSpec("test_30_60", 20, 30.0, 60.0),
        # 32 clips (8 until 2026-12-03: clip i depends only on (seed, split, i) and the
        # fortunes before it, so clips 0-7 are the earlier set unchanged)
        SplitSpec("test_long", 32, 60.0, 240.0),
        SplitSpec("calib", 50, 30.0, 60.0),  # WnW §3.2: "50 ... samples, disjoint from all test sets"
        # held-out text source and register, held-out voices and rates, 1-4 min
        SplitSpec("test_new", 12, 62.0, 235.0, pool="prose", voices=HELDOUT_VOICES,
                  rate_bands=HELDOUT_RATE_BANDS),
        # test_new's words again with one condition moved to training's, for paired factor
        # costs (docs/minivox.md "What test_new's errors come from"); test splits, never trained on
        SplitSpec("test_new_train_voice", 12, 62.0, 235.0, respeak="test_new",
                  training_voice=True),
        SplitSpec("test_new_train_rate", 12, 62.0, 235.0, respeak="test_new",
                  training_rate=True),
        SplitSpec("test_new_train_both", 12, 62.0, 235.0, respeak="test_new",
                  training_voice=True, training_rate=True),
    ])
    # Share of the fortunes reserved for each split (by text); train takes the rest.
    heldout_share: dict[str, float] = field(default_factory=lambda: {
        "dev": 0.04, "test_30_60": 0.12, "test_long": 0.16, "calib": 0.08,
    })
    # the held-out prose source (brotli sdist or lcet10.txt); None: heldout_text.default_source()
    heldout_text: str | None = None
    # the novels' source (r-cran-tidytext .deb or books.rda); None: novel_text.default_source()
    novel_text: str | None = None


# pools read in reading order, clip i from unit i x len(pool) / n_clips on (never shuffled)
READING_ORDER_POOLS = ("prose", "book", "novels")
_WS = re.compile(r"\s+")
_BAD = re.compile(r"[0-9<>{}\[\]|\\/_@#$%^*=~+&]")


def clean_fortune(raw: str) -> str | None:
    """Speakable plain text of one fortune, or None if it is unsuitable.

    Drops attribution lines (``-- Author``), dialogue/markup, non-ASCII, digits (the spoken and
    written forms would differ), and fortunes shorter than 4 words.
    """
    lines = []
    for line in raw.splitlines():
        s = line.strip()
        if s.startswith("--") or s.startswith("-- "):
            break  # attribution
        lines.append(s)
    text = " ".join(lines)
    text = text.replace(" -- ", ", ").replace("--", ", ").replace("`", "'").replace('"', "")
    text = _WS.sub(" ", text).strip()
    if not text or not text.isascii() or _BAD.search(text) or ":" in text[:15]:
        return None
    if not re.search(r"[a-zA-Z]", text):
        return None
    n = len(text.split())
    if n < 4 or n > 120:
        return None
    if text[-1] not in ".!?":
        text += "."
    return text


def text_key(text: str) -> str:
    """The letters of ``text``, lower-cased: two texts with the same key are duplicates."""
    return re.sub(r"[^a-z]", "", text.lower())


def read_fortune_file(path: Path) -> list[str]:
    """The cleaned fortunes of one fortune database file (unsuitable ones dropped)."""
    body = path.read_text(encoding="utf-8", errors="replace")
    return [t for t in map(clean_fortune, body.split("\n%\n")) if t is not None]


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)``, for ``--shard`` options (every n-th manifest row from row i)."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= I < N")
    return i, n


def parse_clips(text: str) -> slice:
    """``"lo:hi"`` -> ``slice(lo, hi)``, for ``--clips`` options (a run of a split's rows)."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI, e.g. 0:8") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= LO < HI")
    return slice(lo, hi)


def add_clip_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a script that studies an adapter on a run of a split's clips:
    ``ADAPTER --data DIR --split S --clips LO:HI``."""
    ap.add_argument("adapter", type=Path)
    ap.add_argument("--data", type=Path, default=Path("data/minivox"))
    ap.add_argument("--split", default="test_long")
    ap.add_argument("--clips", type=parse_clips, default=slice(0, 8),
                    help="LO:HI, a slice of the split's clips")


def fortunes_problem(root: Path = FORTUNE_DIR) -> str | None:
    """Why the fortune databases under ``root`` cannot be read, or None."""
    if root.is_dir():
        return None
    return f"{root}: fortune databases not found (apt-get install fortunes fortunes-min)"


def load_fortunes(root: Path = FORTUNE_DIR) -> list[str]:
    """All cleaned, deduplicated fortunes, in a stable order."""
    problem = fortunes_problem(root)
    if problem:
        raise FileNotFoundError(problem)
    seen: set[str] = set()
    out: list[str] = []
    for f in sorted(root.iterdir()):
        if f.suffix or f.is_dir() or f.name in SKIP_FILES or f.name in EXTRA_FORTUNE_FILES:
            continue
        try:
            texts = read_fortune_file(f)
        except OSError:
            continue
        for t in texts:
            key = text_key(t)
            if key in seen:
                continue
            seen.add(key)
            out.append(t)
    return out


def split_texts(texts: list[str], cfg: DataConfig) -> dict[str, list[str]]:
    """Assign whole fortunes to splits by a seeded shuffle (no text in two splits)."""
    order = list(range(len(texts)))
    random.Random(cfg.seed).shuffle(order)
    out: dict[str, list[str]] = {}
    start = 0
    for name, share in cfg.heldout_share.items():
        n = int(round(share * len(texts)))
        out[name] = [texts[i] for i in order[start : start + n]]
        start += n
    out["train"] = [texts[i] for i in order[start:]]
    return out


def heldout_fortunes(texts: dict[str, list[str]], cfg: DataConfig) -> list[str]:
    """The fortunes of every held-out split of :func:`split_texts`' ``texts``: what no
    training pool may contain."""
    return [t for name in cfg.heldout_share for t in texts[name]]


def _clip_seed(seed: int, split: str, idx: int) -> int:
    h = hashlib.sha256(f"{seed}/{split}/{idx}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def make_clip(tts, pool: list[str], cursor: int, rng: random.Random, min_s: float,
              max_s: float, voice: str | None = None,
              rate_range: tuple[int, int] = TRAIN_RATES,
              exact_words: bool = False,
              time_joined_words: bool = False) -> tuple[dict, int] | None:
    """Synthesise one clip from consecutive fortunes of ``pool`` starting at ``cursor``.

    ``voice`` None draws one of :data:`VOICES`; the rate is drawn from ``rate_range``
    (words/min, inclusive). A fortune whose espeak words disagree with its words is skipped:
    with ``exact_words`` any difference, otherwise a different number of words only.
    ``time_joined_words`` times the words espeak joins to the word before instead of
    leaving them out (:meth:`~.espeak.ESpeak.synth`)."""
    if voice is None:
        voice = rng.choice(VOICES)
    rate = rng.randint(*rate_range)
    pitch = rng.randint(35, 65)
    target = rng.uniform(min_s, max_s)
    clip = ClipAssembly()
    clip.silence(rng.uniform(0.1, 0.6))
    texts = []
    tries = 0
    while tries < 4 * len(pool):
        text = pool[cursor % len(pool)]
        cursor += 1
        tries += 1
        syn = tts.synth(text, voice=voice, rate=rate, pitch=pitch,
                        time_joined=time_joined_words)
        if not words_agree(syn.words, text, exact_words) or syn.audio.size == 0:
            continue  # espeak's word events disagree with the text: skip this fortune
        if clip.t + syn.audio.size / SAMPLE_RATE > max_s:
            if clip.t > min_s:
                break
            continue  # too long to fit: try the next fortune
        clip.speech(syn)
        texts.append(text)
        if clip.t >= target:
            break
        clip.silence(rng.uniform(0.25, 0.9))
    if not texts or clip.t < min_s:
        return None
    return clip.finish(rng, " ".join(texts), voice, rate), cursor


def words_agree(spoken: list[str], text: str, exact: bool) -> bool:
    """Whether espeak's ``spoken`` words are ``text``'s (punctuation stripped, as the manifest
    stores them), or with ``exact`` False, only as many."""
    from .espeak import _PUNCT

    if not exact:
        return len(spoken) == len(text.split())
    return spoken == [w.strip(_PUNCT) for w in text.split()]


def clip_voice_and_rates(spec: SplitSpec, i: int) -> tuple[str | None, tuple[int, int]]:
    """Clip ``i``'s voice (None: drawn from :data:`VOICES`) and speaking-rate range.

    With ``spec.voices`` clip ``i`` gets ``voices[i % n]`` and rate band ``(i // n) % len(bands)``
    (every voice speaks in every band); without, a drawn voice and band ``i % len(bands)``;
    without ``spec.rate_bands`` the band is :data:`TRAIN_RATES`.
    """
    bands = spec.rate_bands or (TRAIN_RATES,)
    if spec.voices:
        n = len(spec.voices)
        return spec.voices[i % n], bands[(i // n) % len(bands)]
    return None, bands[i % len(bands)]


def passage_start(spec: SplitSpec, i: int, pool_size: int) -> int:
    """The unit of a reading-order pool that clip ``i`` of ``spec`` reads from, at the
    earliest: the split's ``n_clips`` passages spread evenly over the pool from ``start`` on
    (a clip starts later only when the one before it ran past this unit)."""
    return int(spec.start * pool_size) + i * pool_size // spec.n_clips


def _drawn_clips(cfg: DataConfig, spec: SplitSpec, tts) -> Iterator[dict]:
    """Clip after clip of ``spec``, its text drawn from its pool."""
    fortunes = load_fortunes()
    texts = split_texts(fortunes, cfg)
    if spec.pool == "prose":
        # reading order, no shuffle; disjoint from every fortune (all splits) and from every
        # extra training text (the unfiltered superset of train_wide's pool)
        training = fortunes + load_extra_texts(fortunes, [], FORTUNE_DIR)
        pool = load_heldout_pool(training, cfg.heldout_text)
    elif spec.pool == "extra":
        pool = load_extra_texts(fortunes, heldout_fortunes(texts, cfg), FORTUNE_DIR)
    elif spec.pool in ("book", "novels"):
        # none of it inside, around or equal to a held-out fortune or a sentence of test_new's
        # source (all of it, before test_new's own filter)
        heldout = heldout_fortunes(texts, cfg) + prose_sentences(read_source(cfg.heldout_text))
        pool = (load_book_pool(heldout, cfg.heldout_text) if spec.pool == "book"
                else load_novel_pool(heldout, cfg.novel_text))
    else:
        pool = list(texts[spec.pool or spec.name])
    if spec.pool not in READING_ORDER_POOLS:
        random.Random(cfg.seed + 1 + (spec.pool is not None)).shuffle(pool)
    cursor = int(spec.start * len(pool))
    for i in range(spec.n_clips):
        rng = random.Random(_clip_seed(cfg.seed, spec.name, i))
        voice, rates = clip_voice_and_rates(spec, i)
        if spec.pool in READING_ORDER_POOLS:
            # passages spread over the text in reading order, none overlapping the last
            cursor = max(cursor, passage_start(spec, i, len(pool)))
        res = make_clip(tts, pool, cursor, rng, spec.min_s, spec.max_s, voice, rates,
                        exact_words=spec.exact_words,
                        time_joined_words=spec.time_joined_words)
        if res is None:
            raise RuntimeError(f"split {spec.name}: could not build clip {i}")
        clip, cursor = res
        yield clip


def _respoken_clips(out: Path, cfg: DataConfig, spec: SplitSpec, tts) -> Iterator[dict]:
    """Clip after clip of ``spec``: its source split's clips read again (:mod:`.respeak`)."""
    from .respeak import respeak_clip, respeak_condition, source_rows

    rows = source_rows(out, spec.respeak)
    if len(rows) != spec.n_clips:
        raise RuntimeError(f"split {spec.name}: {spec.respeak} has {len(rows)} clips, "
                           f"expected {spec.n_clips}")
    for i, row in enumerate(rows):
        voice, band = respeak_condition(row["voice"], row["rate"], train_rates=TRAIN_RATES,
                                        training_voice=spec.training_voice,
                                        training_rate=spec.training_rate)
        rng = random.Random(_clip_seed(cfg.seed, spec.name, i))
        yield respeak_clip(tts, row["text"], voice, band, rng)


def _generate_split(out: Path, cfg: DataConfig, spec: SplitSpec) -> None:
    """Synthesise one split into ``<out>/parts/<split>.parquet`` (run in a fresh process)."""
    import polars as pl
    import soundfile as sf
    from tqdm import tqdm

    from .espeak import ESpeak

    tts = ESpeak()
    clips = (_respoken_clips(out, cfg, spec, tts) if spec.respeak
             else _drawn_clips(cfg, spec, tts))
    adir = out / "audio" / spec.name
    adir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, clip in enumerate(tqdm(clips, total=spec.n_clips, desc=spec.name, mininterval=5)):
        cid = f"{spec.name}-{i:05d}"
        rel = f"audio/{spec.name}/{cid}.flac"
        sf.write(out / rel, clip.pop("audio"), SAMPLE_RATE, subtype="PCM_16")
        dur = sf.info(out / rel).duration
        rows.append({"id": cid, "split": spec.name, "audio_path": rel, "duration": dur, **clip})
    # the split's manifest marks it complete: written whole or not at all
    with atomic_file(out / "parts" / f"{spec.name}.parquet") as tmp:
        pl.DataFrame(rows).write_parquet(tmp)


def missing_inputs(cfg: DataConfig, splits: list[str] | None = None,
                   fortune_root: Path = FORTUNE_DIR, wordnet_root: Path = WORDNET_DIR,
                   espeak_ok: bool | None = None, out: Path | None = None) -> list[str]:
    """Everything generating ``splits`` (None: all) into ``out`` needs and lacks, one message
    each.

    Checked before any split is synthesised, so a missing package or source costs seconds,
    not the splits generated before it. ``espeak_ok`` None: try to load libespeak-ng. A
    re-spoken split needs its source generated with it or complete under ``out`` (not
    checked where ``out`` is None).
    """
    from .espeak import ESPEAK_MISSING, load_library

    known = [s.name for s in cfg.splits]
    unknown = [n for n in splits or [] if n not in known]
    problems = [f"unknown split(s) {unknown}; known: {known}"] if unknown else []
    wanted = [s for s in cfg.splits if not splits or s.name in splits]
    if not wanted:
        return problems
    problems += _missing_respeak_sources(wanted, out)
    if espeak_ok is None:
        try:
            load_library()
            espeak_ok = True
        except RuntimeError:
            espeak_ok = False
    if not espeak_ok:
        problems.append(ESPEAK_MISSING)
    if problem := fortunes_problem(fortune_root):
        problems.append(problem)
    if any(s.pool in ("extra", "prose") for s in wanted):
        problems += missing_sources(fortune_root, wordnet_root)
    for reader in _text_readers(wanted, cfg):
        try:
            reader()
        except (OSError, ValueError, ImportError, tarfile.TarError) as exc:
            problems.append(str(exc))
    return problems


def _text_readers(wanted: list[SplitSpec], cfg: DataConfig) -> list[Callable[[], object]]:
    """Readers of the packaged texts ``wanted``'s pools read: ``test_new``'s source for
    ``prose``, ``book`` and ``novels`` (their units must share no text with it), the book for
    ``book``, the novels (and the R data reader) for ``novels``."""
    pools = {s.pool for s in wanted}
    readers = ([partial(read_source, cfg.heldout_text)]
               if pools & {"prose", "book", "novels"} else [])
    if "book" in pools:
        readers.append(partial(read_book, cfg.heldout_text))
    if "novels" in pools:
        readers += [partial(read_rda, cfg.novel_text), rdata_problem]
    return readers


def _missing_respeak_sources(wanted: list[SplitSpec], out: Path | None) -> list[str]:
    names = {s.name for s in wanted}
    return [f"split {s.name} re-speaks {s.respeak}, which {out} does not hold complete: "
            f"generate {s.respeak} with it (--splits {s.respeak} {s.name})"
            for s in wanted if s.respeak and s.respeak not in names and out is not None
            and not record_path(out, s.respeak).is_file()]


def split_record(cfg: DataConfig, spec: SplitSpec, sources: dict[str, str],
                 espeak: str) -> dict:
    """What a split's clips are a function of: the seed, the split's spec, the held-out shares
    (they decide which fortunes each split reads), the held-out text source, the digests of
    the text files it reads (:func:`source_digests`: an upgraded package changes them) and
    libespeak-ng's version ``espeak`` (:func:`~.espeak.espeak_version`: its voices and rules
    make the audio)."""
    fields = asdict(spec)
    if spec.respeak is None:  # a drawn split's record is as it was before re-spoken splits
        for key in ("respeak", "training_voice", "training_rate"):
            del fields[key]
    for key in ("exact_words", "time_joined_words"):
        if not fields[key]:  # and as it was before the word checks
            del fields[key]
    return {"format": 1, "seed": cfg.seed, "spec": fields,
            "heldout_share": cfg.heldout_share, "heldout_text": cfg.heldout_text,
            "sources": sources, "espeak": espeak}


def files_sha256(paths: list[Path]) -> str:
    """One digest of the names and bytes of ``paths``, in the order given."""
    from kvsim.trace.writer import sha256_file

    lines = "".join(f"{path.name}={sha256_file(path)}\n" for path in paths)
    return hashlib.sha256(lines.encode()).hexdigest()


def source_digests(spec: SplitSpec, fortune_root: Path = FORTUNE_DIR,
                   wordnet_root: Path = WORDNET_DIR) -> dict[str, str]:
    """Digests of the installed text files ``spec``'s clips read: the fortune databases (every
    split: they decide which texts each split gets) and, for the pools that add WordNet's
    sentences (``extra``, and ``prose``, kept disjoint from them), WordNet's data files. The
    held-out prose source is checked against its own SHA-256 when read."""
    fortunes = sorted(f for f in fortune_root.iterdir() if f.is_file())
    out = {"fortunes": files_sha256(fortunes)}
    if spec.pool in ("extra", "prose"):
        out["wordnet"] = files_sha256([wordnet_root / name for name in WORDNET_FILES])
    return out


def _source_record(out: Path, spec: SplitSpec) -> str:
    """The record of the split ``spec`` re-speaks, which must be complete under ``out``."""
    path = record_path(out, spec.respeak)
    if not path.is_file():
        raise RuntimeError(f"split {spec.name}: it re-speaks {spec.respeak}, which {out} does "
                           f"not hold complete (generate {spec.respeak} first)")
    return path.read_text()


def record_path(out: Path, split: str) -> Path:
    """``<out>/parts/<split>.json``: the record of a complete split (:func:`split_record`)."""
    return out / "parts" / f"{split}.json"


def split_is_current(out: Path, record: dict) -> bool:
    """Whether ``out`` holds the split ``record`` describes, complete: its manifest part, a
    record equal to ``record`` (written after the part) and every audio file it lists."""
    import json

    import polars as pl

    name = record["spec"]["name"]
    part, rec = out / "parts" / f"{name}.parquet", record_path(out, name)
    if not (part.is_file() and rec.is_file()):
        return False
    try:
        if json.loads(rec.read_text()) != json.loads(json.dumps(record)):
            return False
        paths = pl.read_parquet(part, columns=["audio_path"])["audio_path"]
    except (OSError, ValueError, pl.exceptions.PolarsError):
        return False
    return all((out / rel).is_file() for rel in paths)


def _write_record(out: Path, record: dict) -> None:
    import json

    with atomic_file(record_path(out, record["spec"]["name"])) as tmp:
        Path(tmp).write_text(json.dumps(record, indent=1) + "\n")


def generate(out: Path, cfg: DataConfig, splits: list[str] | None = None,
             force: bool = False) -> Path:
    """Generate audio + manifest under ``out``; returns the manifest path.

    libespeak-ng keeps state between calls within a process (its output depends on what was
    synthesised before), so every split is synthesised in a fresh process: each split is
    then a deterministic function of (seed, split), whatever else is regenerated. A split
    already complete under ``out`` with the same :func:`split_record` is kept, not
    synthesised again, unless ``force``.
    """
    import multiprocessing as mp

    import polars as pl

    from .espeak import espeak_version

    ctx = mp.get_context("spawn")
    espeak = espeak_version()
    sources_by_pool: dict[str, dict[str, str]] = {}  # the same files for every split of a pool
    for spec in cfg.splits:
        if splits and spec.name not in splits:
            continue
        if spec.pool not in sources_by_pool:
            sources_by_pool[spec.pool] = source_digests(spec)
        sources = sources_by_pool[spec.pool]
        if spec.respeak:  # re-spoken clips are a function of the source split's clips
            sources = {**sources, "respeak": _source_record(out, spec)}
        record = split_record(cfg, spec, sources, espeak)
        if not force and split_is_current(out, record):
            print(f"split {spec.name}: complete with the same seed and spec, kept", file=sys.stderr)
            continue
        record_path(out, spec.name).unlink(missing_ok=True)  # stale until the part is rewritten
        proc = ctx.Process(target=_generate_split, args=(out, cfg, spec))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"split {spec.name}: generation failed (exit {proc.exitcode})")
        _write_record(out, record)
    wanted = [s.name for s in cfg.splits if not splits or s.name in splits]
    parts = [out / "parts" / f"{s.name}.parquet" for s in cfg.splits]
    missing = [str(p) for p in parts if not p.is_file() and p.stem in wanted]
    if missing:
        raise FileNotFoundError(f"missing split manifests: {missing}")
    # a partial corpus (``--splits``) lists the splits generated so far
    parts = [p for p in parts if p.is_file()]
    manifest = out / "manifest.parquet"
    df = pl.concat([pl.read_parquet(p) for p in parts], how="vertical_relaxed")
    with atomic_file(manifest) as tmp:
        df.write_parquet(tmp)
    write_sidecars(out, df)
    return manifest


def write_sidecars(out: Path, df) -> int:
    """``<id>.txt`` (reference) and ``<id>.words.json`` (word timings) next to every held-out
    clip, the sidecars ``kvsim trace`` looks up next to each audio file."""
    import json

    n = 0
    for r in df.filter(~pl_col_split_is_train()).iter_rows(named=True):
        audio = out / r["audio_path"]
        audio.with_suffix(".txt").write_text(r["text"] + "\n")
        audio.with_name(audio.stem + ".words.json").write_text(json.dumps({
            "words": r["words"], "starts": r["word_start"], "ends": r["word_end"]}))
        n += 1
    return n


def pl_col_split_is_train():
    import polars as pl

    return pl.col("split").str.starts_with("train")


def _missing_split_message(path: Path, split: str) -> str:
    """One line for a split the manifest lacks: the command that makes it, or the known names."""
    known = [s.name for s in DataConfig().splits]
    if split in known:
        return (f"{path}: split {split!r} is not generated here: make it with "
                f"python -m kvsim.minivox.data --out {path.parent} --splits {split}")
    return f"{path}: no split {split!r} (the corpus defines: {', '.join(known)})"


def read_manifest(root: str | Path, split: str | None = None):
    """Manifest as a polars DataFrame (optionally one split), with absolute audio paths."""
    import polars as pl

    root = Path(root)
    path = root / "manifest.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: manifest not found (run python -m kvsim.minivox.data)")
    df = pl.read_parquet(path)
    if split is not None:
        df = df.filter(pl.col("split") == split)
        if df.height == 0:
            raise ValueError(_missing_split_message(path, split))
    return df.with_columns((pl.lit(str(root) + "/") + pl.col("audio_path")).alias("abs_path"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/minivox"),
                    help="corpus folder: audio/, parts/, manifest.parquet (default: data/minivox)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of every split's text, voice and rate draws (default: 0)")
    ap.add_argument("--splits", nargs="*", default=None, help="only these splits")
    ap.add_argument("--n-train", type=int, default=None, help="override the train clip count")
    ap.add_argument("--heldout-text", default=None,
                    help="test_new's text source: the brotli sdist, its lcet10.txt or a folder "
                    "holding either (default: $KVSIM_HELDOUT_TEXT, else "
                    "~/.cache/kvsim/minivox/brotli-1.2.1.tar.gz)")
    ap.add_argument("--novel-text", default=None,
                    help="train_longform_novels' source: the r-cran-tidytext .deb, its "
                    "books.rda or a folder holding either (default: "
                    "~/.cache/kvsim/minivox/r-cran-tidytext_0.4.1-1_all.deb)")
    ap.add_argument("--force", action="store_true",
                    help="synthesise every split again, even one complete with the same seed "
                    "and spec (the default keeps it)")
    ap.add_argument("--sidecars-only", action="store_true",
                    help="only (re)write the .txt / .words.json sidecars from the manifest")
    args = ap.parse_args(argv)
    cfg = DataConfig(seed=args.seed, heldout_text=args.heldout_text, novel_text=args.novel_text)
    if args.n_train is not None:
        for s in cfg.splits:
            if s.name == "train":
                s.n_clips = args.n_train
    if not args.sidecars_only:
        problems = missing_inputs(cfg, args.splits, out=args.out)
        for problem in problems:
            print(f"kvsim.minivox.data: error: {problem}", file=sys.stderr)
        if problems:
            raise SystemExit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sidecars_only:
        import polars as pl

        n = write_sidecars(args.out, pl.read_parquet(args.out / "manifest.parquet"))
        print(f"wrote sidecars for {n} clips")
        return
    try:
        path = generate(args.out, cfg, args.splits, force=args.force)
    except RuntimeError as exc:  # a split's process failed; its own traceback is above
        raise SystemExit(f"kvsim.minivox.data: error: {exc}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
