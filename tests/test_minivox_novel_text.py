"""minivox's four-novel training pool: its source, its units, and disjointness."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from kvsim.minivox import data as D
from kvsim.minivox import heldout_text as H
from kvsim.minivox import novel_text as N

# a novel's lines in tidytext's books.rda, in small: title page, transcriber's note, a
# chapter heading with its title, narrative, a one-line letter salutation in capitals
SAMPLE = """\
THE WAR OF THE WORLDS

by H. G. Wells [1898]

This etext was done by volunteers of the Gutenberg Project, to whom we owe thanks.


CHAPTER ONE

THE EVE OF THE WAR


No one would have believed in the last years of the nineteenth
century that this world was being watched keenly and closely.

MY DEAR FRIEND,--

I write in haste, for the CYLINDER has opened and the crowd is
running down the lane towards Woking.
"""


def test_novel_body_starts_at_the_first_chapter_and_drops_heading_lines():
    body = N.novel_body(SAMPLE)
    assert body.lstrip().startswith("No one would have believed")
    assert "Gutenberg" not in body and "by H. G. Wells" not in body
    kept = [ln for ln in body.split("\n") if ln.strip()]
    # one-line paragraphs without a lower-case letter are headings; CYLINDER inside a
    # narrative line stays (speakable lower-cases it later)
    assert not {"CHAPTER ONE", "THE EVE OF THE WAR", "MY DEAR FRIEND,--"} & set(kept)
    assert any("CYLINDER" in ln for ln in kept)


def test_novel_units_are_the_narrative_sentences_in_novel_order():
    novels = {i: SAMPLE.replace("Woking", f"Woking {name}") for i, name in
              zip(N.NOVELS, ("first", "second", "third", "fourth"), strict=True)}
    units = N.novel_units(novels)
    assert len(units) == 8
    assert units[0].startswith("No one would have believed")
    assert [u.rsplit(" ", 1)[-1] for u in units[1::2]] == ["first.", "second.", "third.",
                                                             "fourth."]
    assert "the cylinder has opened" in units[1]


def test_missing_or_altered_source_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get download r-cran-tidytext=0.4.1-1"):
        N.read_rda(tmp_path)
    bad = tmp_path / "books.rda"
    bad.write_bytes(b"not R data")
    with pytest.raises(ValueError, match=r"books\.rda has SHA-256 [0-9a-f]{64}, expected"):
        N.read_rda(tmp_path)  # a folder holding books.rda reads it
    deb = tmp_path / N.DEB_NAME
    deb.write_bytes(b"not a deb")
    if N.shutil.which("dpkg-deb"):
        with pytest.raises(ValueError, match="not a readable .deb"):
            N.read_rda(deb)


def test_missing_rdata_package_is_named(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_rdata(name, *args, **kwargs):
        if name == "rdata":
            raise ImportError("No module named 'rdata'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rdata)
    with pytest.raises(ImportError, match="pip install rdata"):
        N.rdata_problem()


def test_missing_novels_are_named_before_anything_is_synthesised(tmp_path):
    cfg = D.DataConfig(novel_text=str(tmp_path / "nowhere.deb"))
    problems = D.missing_inputs(cfg, ["train_longform_novels"], espeak_ok=True)
    assert any("books.rda" in p and "apt-get download" in p for p in problems)


def test_novels_split_reads_the_book_register_at_scale_with_joined_words_timed():
    splits = {s.name: s for s in D.DataConfig().splits}
    novels, book = splits["train_longform_novels"], splits["train_longform_book"]
    assert novels.pool == "novels" and "novels" in D.READING_ORDER_POOLS
    assert (novels.n_clips, novels.min_s, novels.max_s) == (book.n_clips, book.min_s,
                                                           book.max_s)
    assert (novels.voices, novels.rate_bands) == (None, None)
    assert novels.exact_words and novels.time_joined_words


def test_second_novels_split_reads_between_the_firsts_passages():
    """train_longform_novels_2 interleaves with train_longform_novels: every passage of one
    starts at least 60 units (a clip reads 60 at most, checked on the generated splits)
    from every passage of the other, and the last leaves 60 units of the pool."""
    splits = {s.name: s for s in D.DataConfig().splits}
    first, second = splits["train_longform_novels"], splits["train_longform_novels_2"]
    assert (second.pool, second.n_clips, second.exact_words, second.time_joined_words) == (
        "novels", 3 * first.n_clips, True, True)
    for size in (21_544, 20_000, 23_000):  # the pool's size, and around it
        a = np.array([D.passage_start(first, i, size) for i in range(first.n_clips)])
        b = np.array([D.passage_start(second, i, size) for i in range(second.n_clips)])
        assert a[0] == 0 and np.all(np.diff(a) > 0) and np.all(np.diff(b) > 0)
        assert np.abs(a[:, None] - b[None, :]).min() >= 60
        assert b[-1] + 60 <= size


def test_a_reading_order_split_without_start_reads_as_before():
    """start = 0 (every split made before the second novels split): clip i from unit
    i x pool / n_clips, so those splits regenerate byte for byte."""
    spec = {s.name: s for s in D.DataConfig().splits}["train_longform_novels"]
    assert spec.start == 0.0
    assert [D.passage_start(spec, i, 21_544) for i in (0, 1, 47)] == [0, 448, 21_095]


def _real_pool() -> tuple[list[str], list[str]]:
    """The novels' pool as the generator draws it, and the held-out texts it must avoid."""
    try:
        N.rdata_problem()
        source, fortunes = H.read_source(), D.load_fortunes()
        texts = D.split_texts(fortunes, D.DataConfig())
        heldout = D.heldout_fortunes(texts, D.DataConfig()) + H.prose_sentences(source)
        return N.load_novel_pool(heldout), heldout
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(str(exc))


def test_real_novel_pool_is_four_novels_disjoint_from_every_held_out_text():
    pool, heldout = _real_pool()
    assert len(pool) > 20000 and sum(len(u.split()) for u in pool) > 400_000
    assert pool[0].startswith("No one would have believed in the last years")  # Wells
    assert pool[-1].startswith("I took her hand in mine")  # Great Expectations' last
    assert sum(u.startswith("It is a truth universally acknowledged") for u in pool) == 1
    blob = "|".join(D.text_key(t) for t in heldout)
    assert not any(D.text_key(u) in blob for u in pool)


def _generated(split: str):
    import polars as pl

    root = Path(os.environ.get("KVSIM_MINIVOX_DATA", "data/minivox"))
    if not (root / "parts" / f"{split}.parquet").is_file():
        pytest.skip(f"{root}: no {split} split (set KVSIM_MINIVOX_DATA)")
    return pl.read_parquet(root / "parts" / f"{split}.parquet")


def _units_read(split: str, pool: list[str]) -> list[range]:
    """The pool units each clip of a generated split reads, checking on the way that each
    starts where its passage does or after, and never at a unit an earlier clip read."""
    from kvsim.minivox.espeak import _PUNCT

    clips = _generated(split)
    spec = {s.name: s for s in D.DataConfig().splits}[split]
    index = {u: p for p, u in enumerate(pool)}
    read: list[range] = []
    for i, (text, words) in enumerate(zip(clips["text"], clips["words"], strict=True)):
        assert list(words) == [w.strip(_PUNCT) for w in text.split()]
        last = read[-1].stop - 1 if read else -1
        first = next(p for p in range(max(D.passage_start(spec, i, len(pool)), last + 1),
                                      len(pool)) if text.startswith(pool[p]))
        read.append(range(first, first + _units_in(text[len(pool[first]):], pool, first,
                                                    index) + 1))
    return read


@pytest.mark.parametrize("split", ["train_longform_novels", "train_longform_novels_2"])
def test_generated_novels_split_is_distinct_text_in_reading_order(split):
    """On a generated corpus (``KVSIM_MINIVOX_DATA``): each clip reads units of the pool in
    order, from its own passage on, no clip reading another's, every word list the text's,
    none more than 60 units."""
    pool, _ = _real_pool()
    read = _units_read(split, pool)
    assert all(a.stop <= b.start for a, b in itertools.pairwise(read))
    assert max(len(r) for r in read) <= 60


def test_generated_novels_splits_share_no_text():
    pool, _ = _real_pool()
    first = set().union(*_units_read("train_longform_novels", pool))
    second = set().union(*_units_read("train_longform_novels_2", pool))
    assert len(first) > 900 and len(second) > 2700 and not first & second


def _units_in(rest: str, pool: list[str], at: int, index: dict[str, int]) -> int:
    """How many units after ``at`` the rest of a clip's text runs through (units espeak
    rejected are skipped, so a clip may pass over a few)."""
    pos = at
    while rest.strip():
        rest = rest.lstrip()
        nxt = next(p for p in range(pos + 1, min(pos + 20, len(pool))) if rest.startswith(pool[p]))
        rest, pos = rest[len(pool[nxt]):], nxt
    return pos - at
