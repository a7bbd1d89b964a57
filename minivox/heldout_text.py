"""Held-out prose for minivox's ``test_new`` split: a text source no training split uses.

The training text is Debian fortunes (quotations, jokes, short literature excerpts) and
WordNet 3.0 glosses (:mod:`kvsim.minivox.extra_text`). ``test_new`` reads *expository
report prose* instead: the proceedings of the Library of Congress "Workshop on Electronic
Texts" (9-10 June 1992, edited by James Daly; Project Gutenberg etext, the ``lcet10.txt`` of
the Canterbury compression corpus). The file ships in the source distribution of the PyPI
package ``brotli`` (MIT licence; ``tests/testdata/lcet10.txt``), pinned here by version and
SHA-256, so the split is regenerated from the same bytes::

    pip download --no-deps --no-binary :all: brotli==1.2.1 -d ~/.cache/kvsim/minivox

The proceedings are a publication of the Library of Congress, a U.S. federal agency,
distributed by Project Gutenberg as a public-domain etext.

:func:`prose_sentences` turns the file into speakable sentences in reading order: prose
paragraphs only (no headings, lists, indented notes, directories), footnote markers dropped,
the proceedings' upper-case surnames (``Anne KENNEY``) written as names, and sentences with
acronyms (``CD-ROM``, ``SGML``), digits or markup dropped, with
:func:`kvsim.minivox.data.clean_fortune`'s rules. :func:`exclude_overlaps` then drops any
sentence that equals, contains or lies inside a text of the training pools, so the split is
disjoint from every other split's text.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

from kvsim.cache import kvsim_cache

BROTLI_VERSION = "1.2.1"
SDIST_NAME = f"brotli-{BROTLI_VERSION}.tar.gz"


def testdata_member(filename: str) -> str:
    """The path of ``tests/testdata/<filename>`` inside the brotli sdist."""
    return f"brotli-{BROTLI_VERSION}/tests/testdata/{filename}"


MEMBER = testdata_member("lcet10.txt")
SHA256 = "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f"
DOWNLOAD = (f"pip download --no-deps --no-binary :all: brotli=={BROTLI_VERSION} "
            "-d ~/.cache/kvsim/minivox")
# a training text this short (in letters) inside a held-out sentence is a phrase, not a leak
MIN_CONTAINED_KEY = 24

_ABBREV = re.compile(r"\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Inc|Co|Corp|vs|etc|e\.g|i\.e|U\.S|D\.C|"
                     r"[A-Z])\.$")
_SENT_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_FOOTNOTE = re.compile(r"\s*\(\d+\)")
_UPPER_WORD = re.compile(r"\b[A-Z][A-Za-z]*[A-Z](?:-[A-Z][A-Za-z]*[A-Z])*\b")


def default_source() -> Path:
    """Where :func:`read_source` looks without a path: ``$KVSIM_HELDOUT_TEXT``, else the
    sdist in ``$KVSIM_CACHE`` (or ``~/.cache/kvsim``) ``/minivox/``."""
    env = os.environ.get("KVSIM_HELDOUT_TEXT")
    if env:
        return Path(env)
    return kvsim_cache("minivox", SDIST_NAME)


def tar_member(tf: tarfile.TarFile, member: str, where: Path) -> bytes:
    """The bytes of ``member`` of the open archive ``tf``; FileNotFoundError naming ``where``
    (the archive's file) where it holds no such file."""
    try:
        handle = tf.extractfile(member)
    except KeyError:
        handle = None
    if handle is None:
        raise FileNotFoundError(f"{where}: no {member}")
    return handle.read()


def check_sha256(data: bytes, sha256: str, where: Path, name: str, origin: str) -> None:
    """ValueError naming ``where``, the file ``name`` and its ``origin`` (package and version)
    unless ``data`` has the SHA-256 ``sha256``: a pinned source whose bytes changed."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"{where}: {name} has SHA-256 {digest}, expected {sha256} ({origin})")


def read_testdata(path: str | Path | None, filename: str, sha256: str) -> str:
    """The text of ``tests/testdata/<filename>`` of the brotli sdist, checked against
    ``sha256``. ``path``: the sdist (``.tar.gz``), the extracted file, another file of the
    same folder (the file is read beside it), or a folder holding the sdist or the file;
    None: :func:`default_source`."""
    p = Path(path) if path is not None else default_source()
    if p.is_file() and p.name not in (SDIST_NAME, filename):
        p = p.parent
    member = testdata_member(filename)
    if p.is_dir():
        for cand in (p / SDIST_NAME, p / filename, p / member):
            if cand.is_file():
                p = cand
                break
    if not p.is_file():
        raise FileNotFoundError(f"{p}: {filename} (brotli {BROTLI_VERSION} sdist) not found; "
                                f"fetch it with: {DOWNLOAD}")
    if p.name.endswith(".tar.gz"):
        with tarfile.open(p) as tf:
            data = tar_member(tf, member, p)
    else:
        data = p.read_bytes()
    check_sha256(data, sha256, p, filename, f"brotli {BROTLI_VERSION}")
    return data.decode("ascii")


def read_source(path: str | Path | None = None) -> str:
    """The text of ``lcet10.txt``, from the brotli sdist (``.tar.gz``), the extracted file,
    or a folder holding either; checked against :data:`SHA256`."""
    return read_testdata(path, "lcet10.txt", SHA256)


def split_sentences(text: str) -> list[str]:
    """``text``'s sentences, split after ., ! or ? and a space, except after an abbreviation."""
    out: list[str] = []
    for part in _SENT_END.split(text):
        if out and _ABBREV.search(out[-1]):
            out[-1] += " " + part
        else:
            out.append(part)
    return out


def prose_paragraphs(raw: str) -> list[str]:
    """Running-text paragraphs in reading order, each joined onto one line.

    A paragraph is dropped if any line is indented or starts with ``*``, ``+`` or ``[``
    (notes, tables of contents, lists, session banners, the directory of participants) or if
    most of its letters are upper case (headings)."""
    out = []
    for para in re.split(r"\n\s*\n", raw.replace("\r\n", "\n")):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines or any(ln[:1].isspace() or ln[:1] in "*+[" for ln in lines):
            continue
        text = " ".join(ln.strip() for ln in lines)
        letters = re.sub(r"[^A-Za-z]", "", text)
        if not letters or sum(c.isupper() for c in letters) > 0.5 * len(letters):
            continue
        out.append(text)
    return out


def prose_sentences(raw: str, min_words: int = 5) -> list[str]:
    """Speakable sentences of ``raw`` in reading order (see the module docstring).

    An upper-case word is written as a name (``KENNEY`` -> ``Kenney``) when that
    capitalised form occurs somewhere in the text (the directory of participants lists
    every speaker); a sentence with any other upper-case word of two or more letters (an
    acronym) is dropped, as is one that :func:`~kvsim.minivox.data.clean_fortune` rejects
    (digits, markup, non-ASCII) or that has fewer than ``min_words`` words."""
    from .data import clean_fortune

    names = set(re.findall(r"\b[A-Z][a-z]+\b", raw))

    def as_name(m: re.Match) -> str:
        parts = m.group(0).split("-")
        if all(p.capitalize() in names for p in parts):
            return "-".join(p.capitalize() for p in parts)
        return m.group(0)

    out = []
    for para in prose_paragraphs(raw):
        para = _FOOTNOTE.sub("", para)
        for sent in split_sentences(para):
            sent = _UPPER_WORD.sub(as_name, sent)
            if _UPPER_WORD.search(sent) or "Cont'd" in sent:
                continue
            t = clean_fortune(sent)
            if t is not None and len(t.split()) >= min_words:
                out.append(t)
    return out


def exclude_overlaps(sentences: list[str], training: Iterable[str],
                     min_contained: int = MIN_CONTAINED_KEY) -> list[str]:
    """``sentences`` without those that share text with ``training`` (order kept).

    Compared as :func:`~kvsim.minivox.data.text_key` (letters only, lower case): a sentence
    is dropped if its key equals or lies inside a training text's key, or if a training
    text's key of at least ``min_contained`` letters lies inside it. Duplicates within
    ``sentences`` are dropped too."""
    from .data import text_key

    train_keys = [k for k in (text_key(t) for t in training) if k]
    train_blob = "|".join(train_keys)
    keys = [text_key(s) for s in sentences]
    blob = "|".join(keys)
    contained = {k for k in train_keys if len(k) >= min_contained and k in blob}
    out, seen = [], set()
    for s, k in zip(sentences, keys, strict=True):
        if not k or k in seen or k in train_blob or any(c in k for c in contained):
            continue
        seen.add(k)
        out.append(s)
    return out


def load_heldout_pool(training: Iterable[str], path: str | Path | None = None) -> list[str]:
    """The ``test_new`` text pool: :func:`prose_sentences` of the source minus
    :func:`exclude_overlaps` with ``training``, in reading order."""
    return exclude_overlaps(prose_sentences(read_source(path)), training)
