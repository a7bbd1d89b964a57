"""Extra training text for minivox: WordNet sentences and the ``anarchism`` fortunes.

The fortune pool alone (about 5,400 training fortunes, 107k words) is small enough that
stage-2 training memorises it: after 1.8 epochs the loss on training clips fell by 62% while
the loss on held-out clips did not move (``scripts/minivox_loss_gap.py``). This module adds
distinct English text for the *training* splits only, from two Debian packages:

- ``wordnet-base``: the WordNet 3.0 database. Every synset's gloss gives its usage examples
  (``"she choked with emotion when she spoke"``) and its definition, spoken as
  ``"<lemma>, <definition>."``; tens of thousands of modern-English sentences and phrases
  over a vocabulary far wider than the fortunes'.
- ``fortune-anarchism``: a fortune database of about 900 quotations that is not part of the
  ``fortunes`` / ``fortunes-min`` packages the held-out splits come from.

Every text goes through :func:`kvsim.minivox.data.clean_fortune`'s rules. A text whose
letters equal those of any base fortune, or occur inside a held-out fortune (a WordNet
example quoting a proverb that a test clip speaks), is dropped, so no held-out text enters
the training pool this way.
"""

from __future__ import annotations

import re
from pathlib import Path

WORDNET_DIR = Path("/usr/share/wordnet")
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
EXTRA_FORTUNE_FILES = ("anarchism",)
_QUOTED = re.compile(r'"([^"]+)"')


def parse_wordnet_line(line: str) -> tuple[list[str], str, list[str]] | None:
    """``(lemmas, definition, examples)`` of one ``data.*`` line, or None for the header.

    The format (wndb(5WN)): ``offset lex_filenum ss_type w_cnt word lex_id [word lex_id...]
    p_cnt [ptr...] [frames...] | gloss``; ``w_cnt`` is two hex digits. The gloss is the
    definition followed by ``; "example"`` parts.
    """
    if not line[:1].isdigit() or " | " not in line:
        return None
    head, gloss = line.split(" | ", 1)
    fields = head.split()
    n_words = int(fields[3], 16)
    lemmas = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
    lemmas = [re.sub(r"\([a-z]+\)$", "", w) for w in lemmas]  # adjective markers: (a), (p)
    examples = _QUOTED.findall(gloss)
    definition = _QUOTED.sub("", gloss).split(";")[0].strip()
    return lemmas, definition, examples


def wordnet_problem(root: Path = WORDNET_DIR) -> str | None:
    """Why the WordNet database under ``root`` cannot be read, or None."""
    missing = [f for f in WORDNET_FILES if not (root / f).is_file()]
    if missing:
        return f"{root}: WordNet database files {missing} not found (apt-get install wordnet-base)"
    return None


def extra_fortune_problem(root: Path, name: str) -> str | None:
    """Why the extra fortune file ``name`` under ``root`` cannot be read, or None."""
    f = root / name
    return None if f.is_file() else f"{f}: not found (apt-get install fortune-{name})"


def missing_sources(fortune_root: Path, wordnet_root: Path = WORDNET_DIR) -> list[str]:
    """Every file :func:`load_extra_texts` needs and cannot find, one message each."""
    problems = [wordnet_problem(wordnet_root)]
    problems += [extra_fortune_problem(fortune_root, n) for n in EXTRA_FORTUNE_FILES]
    return [p for p in problems if p]


def load_wordnet_texts(root: Path = WORDNET_DIR) -> list[str]:
    """Cleaned example sentences and ``"<lemma>, <definition>."`` texts, in a stable order."""
    from .data import clean_fortune

    problem = wordnet_problem(root)
    if problem:
        raise FileNotFoundError(problem)
    out: list[str] = []
    for name in WORDNET_FILES:
        for line in (root / name).read_text(encoding="utf-8", errors="replace").splitlines():
            parsed = parse_wordnet_line(line)
            if parsed is None:
                continue
            lemmas, definition, examples = parsed
            for ex in examples:
                t = clean_fortune(ex[:1].upper() + ex[1:])
                if t is not None:
                    out.append(t)
            if definition:
                t = clean_fortune(f"{lemmas[0][:1].upper()}{lemmas[0][1:]}, {definition}")
                if t is not None:
                    out.append(t)
    return out


def load_extra_fortunes(root: Path) -> list[str]:
    """Cleaned fortunes of :data:`EXTRA_FORTUNE_FILES` present under ``root``."""
    from .data import read_fortune_file

    out = []
    for name in EXTRA_FORTUNE_FILES:
        problem = extra_fortune_problem(root, name)
        if problem:
            raise FileNotFoundError(problem)
        out += read_fortune_file(root / name)
    return out


def load_extra_texts(base: list[str], heldout: list[str], fortune_root: Path,
                     wordnet_root: Path = WORDNET_DIR) -> list[str]:
    """Deduplicated extra training texts, in a stable order.

    None has the letters of a text in ``base`` (the fortunes of all splits), and none is
    contained in a ``heldout`` text (a short WordNet example quoted inside a test fortune).
    """
    from .data import text_key

    seen = {text_key(t) for t in base}
    blob = "|".join(text_key(t) for t in heldout)
    out = []
    for t in load_extra_fortunes(fortune_root) + load_wordnet_texts(wordnet_root):
        k = text_key(t)
        if k and k not in seen and k not in blob:
            seen.add(k)
            out.append(t)
    return out
