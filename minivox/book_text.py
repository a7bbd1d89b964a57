"""Narrative training prose for minivox: *Alice's Adventures in Wonderland*, in reading order.

Every other training text is short and self-contained: fortunes (quotations, jokes) and
WordNet glosses (:mod:`kvsim.minivox.extra_text`). A long-form clip of them is a string of
unrelated sentences, which is not how minutes of speech run. This pool is one continuous
book: Lewis Carroll's *Alice's Adventures in Wonderland* (1865, public domain; the
"Millennium Fulcrum Edition 2.9" etext of Project Gutenberg, this copy without a licence
header), the ``alice29.txt`` of the Canterbury compression corpus. It ships beside
``test_new``'s source in the source distribution of the PyPI package ``brotli``
(``tests/testdata/alice29.txt``, MIT licence), pinned by version and SHA-256::

    pip download --no-deps --no-binary :all: brotli==1.2.1 -d ~/.cache/kvsim/minivox

The register is narrative fiction with dialogue: neither the fortunes' nor WordNet's, and
not ``test_new``'s expository report prose, which stays held out.

:func:`book_units` turns the book into speakable units in reading order: the narrative
paragraphs (no title, chapter headings or indented verse), line-end hyphens joined, words
in capitals for emphasis (``VERY``) lower-cased, quotation marks dropped (apostrophes
inside words kept), then sentences, a sentence of fewer than ``min_words`` words joined to
the next one of its paragraph, each unit cleaned with
:func:`kvsim.minivox.data.clean_fortune`'s rules. :func:`load_book_pool` drops every unit
that shares text with a held-out text (:func:`~kvsim.minivox.heldout_text.exclude_overlaps`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from .heldout_text import exclude_overlaps, read_testdata, split_sentences

FILENAME = "alice29.txt"
SHA256 = "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0"

_CAPS_WORD = re.compile(r"\b[A-Za-z']*[A-Z]{2}[A-Za-z']*")
_QUOTE = re.compile(r"(?<![A-Za-z])'|'(?![A-Za-z])")
_LINE_HYPHEN = re.compile(r"(?<=[A-Za-z])-\n(?=[A-Za-z])")


def read_book(path: str | Path | None = None) -> str:
    """The text of ``alice29.txt`` (see :func:`~kvsim.minivox.heldout_text.read_testdata`
    for ``path``), checked against :data:`SHA256`."""
    return read_testdata(path, FILENAME, SHA256)


def book_paragraphs(raw: str) -> list[str]:
    """The narrative paragraphs of ``raw`` in reading order, each on one line.

    A narrative paragraph's first line is indented by at most two spaces and its other lines
    not at all; the title block, chapter headings and the poems (indented throughout) are
    dropped. A hyphen that ends a line joins the word across it (``WAISTCOAT-`` /
    ``POCKET``)."""
    out = []
    for para in re.split(r"\n\s*\n", raw.replace("\r\n", "\n")):
        lines = [ln.rstrip() for ln in para.split("\n") if ln.strip()]
        if not lines:
            continue
        first_indent = len(lines[0]) - len(lines[0].lstrip())
        if first_indent > 2 or any(ln[:1].isspace() for ln in lines[1:]):
            continue
        text = _LINE_HYPHEN.sub("-", "\n".join(ln.strip() for ln in lines))
        out.append(text.replace("\n", " "))
    return out


def speakable(sentence: str) -> str:
    """``sentence`` with words in capitals for emphasis (``VERY``, ``UNimportant``)
    lower-cased and quotation marks (the book's backquote and quote) dropped; apostrophes
    inside words stay."""
    sentence = sentence.replace("`", "'")
    sentence = _CAPS_WORD.sub(lambda m: m.group(0).lower(), sentence)
    return _QUOTE.sub("", sentence)


def book_units(raw: str, min_words: int = 5) -> list[str]:
    """Speakable units of the book in reading order (see the module docstring): sentences,
    one shorter than ``min_words`` words joined to the next of its paragraph (a paragraph's
    short last sentence is kept only if it reaches ``min_words`` with the one before)."""
    from .data import clean_fortune

    out = []
    for para in book_paragraphs(raw):
        units: list[str] = []
        for sent in split_sentences(speakable(para)):
            if units and len(units[-1].split()) < min_words:
                units[-1] += " " + sent
            else:
                units.append(sent)
        if len(units) > 1 and len(units[-1].split()) < min_words:
            tail = units.pop()
            units[-1] += " " + tail
        for unit in units:
            t = clean_fortune(unit)
            if t is not None and len(t.split()) >= min_words:
                out.append(t)
    return out


def load_book_pool(heldout: Iterable[str], path: str | Path | None = None) -> list[str]:
    """The book's units minus those sharing text with ``heldout`` (the held-out fortunes
    and ``test_new``'s prose), in reading order."""
    return exclude_overlaps(book_units(read_book(path)), heldout)
