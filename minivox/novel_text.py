"""Narrative training prose for minivox at scale: four public-domain novels in reading order.

:mod:`kvsim.minivox.book_text`'s one book holds 24,681 words, fewer than a long-form split of
48 clips reads. This pool is four novels, 448,000 words of units: H. G. Wells, *The War of
the Worlds* (1898), Jules Verne, *Twenty Thousand Leagues under the Sea* (the anonymous
early translation), Jane Austen, *Pride and Prejudice* (1813), and Charles Dickens, *Great
Expectations* (1861), Project Gutenberg etexts 36, 164, 1342 and 1400 without Gutenberg's
licence text, all public domain. They ship as a data frame of text lines,
``extdata/books.rda``, in the Debian package of the R library tidytext (``r-cran-tidytext``
0.4.1-1, MIT licence), pinned here by the file's SHA-256::

    cd ~/.cache/kvsim/minivox && apt-get download r-cran-tidytext=0.4.1-1

(no R needed: the ``.deb`` is read with ``dpkg-deb`` and the R data file with the PyPI
package ``rdata``; the extracted ``books.rda`` is read as well). The register is narrative
fiction with dialogue, as the book's: not ``test_new``'s expository report prose, which
stays held out.

Each novel's lines from its first chapter on, headings dropped (:func:`novel_body`), go
through :func:`~kvsim.minivox.book_text.book_units` (narrative paragraphs, sentences, short
ones joined); :func:`load_novel_pool` orders the novels by etext
number and drops every unit that shares text with a held-out text
(:func:`~kvsim.minivox.heldout_text.exclude_overlaps`).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterable
from pathlib import Path

from kvsim.cache import kvsim_cache

from .book_text import book_units
from .heldout_text import check_sha256, exclude_overlaps, tar_member

DEB_VERSION = "0.4.1-1"
DEB_NAME = f"r-cran-tidytext_{DEB_VERSION}_all.deb"
MEMBER = "./usr/lib/R/site-library/tidytext/extdata/books.rda"
FILENAME = "books.rda"
SHA256 = "3953a24db22a9012a6a3de1ef816229f62fdefdf04bc24b83830477505fd7b2a"
DOWNLOAD = f"cd ~/.cache/kvsim/minivox && apt-get download r-cran-tidytext={DEB_VERSION}"
_CHAPTER = re.compile(r"\s*chapter\b", re.IGNORECASE)
_LOWER = re.compile("[a-z]")
# etext number -> title, in the order the pool reads them
NOVELS = {36: "The War of the Worlds", 164: "Twenty Thousand Leagues under the Sea",
          1342: "Pride and Prejudice", 1400: "Great Expectations"}


def default_source() -> Path:
    """The ``.deb`` in ``$KVSIM_CACHE`` (or ``~/.cache/kvsim``) ``/minivox/``."""
    return kvsim_cache("minivox", DEB_NAME)


def _resolve(path: str | Path | None) -> Path:
    """``path`` (None: :func:`default_source`): the ``.deb``, ``books.rda``, or a folder
    holding either."""
    p = Path(path) if path is not None else default_source()
    if p.is_dir():
        p = next((c for c in (p / DEB_NAME, p / FILENAME) if c.is_file()), p / DEB_NAME)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: {FILENAME} (r-cran-tidytext {DEB_VERSION}) not found; "
                                f"fetch it with: {DOWNLOAD}")
    return p


def _deb_member(deb: Path) -> bytes:
    """``books.rda`` out of ``deb``, through ``dpkg-deb --fsys-tarfile``."""
    import tarfile

    if shutil.which("dpkg-deb") is None:
        raise FileNotFoundError(f"{deb}: reading a .deb needs dpkg-deb; extract {MEMBER} "
                                f"with any ar/tar tool and pass {FILENAME} instead")
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                         check=False)
    if tar.returncode != 0:
        raise ValueError(f"{deb}: not a readable .deb ({tar.stderr.decode().strip()})")
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as tf:
        return tar_member(tf, MEMBER, deb)


def read_rda(path: str | Path | None = None) -> bytes:
    """The bytes of ``books.rda`` (from the ``.deb``, the file, or a folder holding either),
    checked against :data:`SHA256`."""
    p = _resolve(path)
    data = _deb_member(p) if p.suffix == ".deb" else p.read_bytes()
    check_sha256(data, SHA256, p, FILENAME, f"r-cran-tidytext {DEB_VERSION}")
    return data


def rdata_problem() -> None:
    """ImportError with the install command where the PyPI package ``rdata`` is missing."""
    try:
        import rdata  # noqa: F401
    except ImportError as exc:
        raise ImportError("the novels' R data needs the PyPI package rdata: "
                          "pip install rdata (or kvsim[speech])") from exc


def read_novels(path: str | Path | None = None) -> dict[int, str]:
    """Each novel of :data:`NOVELS` as one text, its lines joined by newlines, keyed by
    etext number (see :func:`read_rda` for ``path``)."""
    rdata_problem()
    import rdata

    parsed = rdata.parser.parse_data(read_rda(path))
    with warnings.catch_warnings():  # tibble classes convert as data frames
        warnings.simplefilter("ignore", UserWarning)
        books = rdata.conversion.convert(parsed)["books"]
    ids = [int(i) for i in books["gutenberg_id"]]
    found = set(ids)
    if found != set(NOVELS):
        raise ValueError(f"{FILENAME}: etexts {sorted(found)}, expected {sorted(NOVELS)}")
    lines: dict[int, list[str]] = {i: [] for i in NOVELS}
    for i, line in zip(ids, books["text"], strict=True):
        lines[i].append("" if line is None or line != line else str(line))  # NA: blank
    return {i: "\n".join(lines[i]) for i in NOVELS}


def novel_body(raw: str) -> str:
    """``raw`` from its first chapter heading on (no title page or transcriber's note), less
    the one-line paragraphs without a lower-case letter (headings such as ``CHAPTER TWO`` /
    ``THE FALLING STAR``, a letter's ``MY DEAR FRIEND,--``)."""
    lines = raw.split("\n")
    first = next((k for k, ln in enumerate(lines) if _CHAPTER.match(ln)), 0)
    lines = ["", *lines[first:], ""]
    return "\n".join(ln for k, ln in enumerate(lines[1:-1], start=1)
                     if not (ln.strip() and not _LOWER.search(ln)
                             and not lines[k - 1].strip() and not lines[k + 1].strip()))


def novel_units(novels: dict[int, str], min_words: int = 5) -> list[str]:
    """:func:`~kvsim.minivox.book_text.book_units` of each novel's :func:`novel_body`, in
    :data:`NOVELS` order."""
    return [u for i in NOVELS for u in book_units(novel_body(novels[i]), min_words)]


def load_novel_pool(heldout: Iterable[str], path: str | Path | None = None) -> list[str]:
    """The novels' units minus those sharing text with ``heldout`` (the held-out fortunes and
    ``test_new``'s prose), in reading order."""
    return exclude_overlaps(novel_units(read_novels(path)), heldout)
