"""Subword regularisation of training transcripts: some words spelled in two token pieces.

minivox's tokenizer (49,152 byte-level BPE tokens) spells most English words as one token, so
the trainer only ever asks the model to map a word's sound to that word's token, and a word
heard rarely in training is one it cannot read (docs/minivox.md, "Words it has not heard").
Subword regularisation trains on other segmentations of the same text: sampled unigram
segmentations (Kudo, 2018, "Subword Regularization", ACL) or BPE merges dropped at random
(Provilkov et al., 2020, "BPE-Dropout", ACL §3), so that a model learns the sound of word
pieces too. Here, a simpler sampler with the same aim: each word of four or more letters is,
with probability ``share``, cut at a uniformly drawn letter boundary and each side tokenized
alone (the first with the word's leading space). The pieces decode to the same text, so
decoding and scoring are unchanged; only the training targets (and the guided-attention
targets, which follow each token's word) change. ``share`` 0 gives the tokenizer's own
encoding, token for token.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# a word that may be cut: a run of four or more ASCII letters (byte-level BPE pre-tokenizes
# a run of letters, with its leading space, as one unit)
CUTTABLE = re.compile(r"[A-Za-z]{4,}")


@dataclass(frozen=True)
class Encoding:
    """Token ids of a text and the character span ``[start, end)`` each token spells."""

    ids: list[int]
    offsets: list[tuple[int, int]]


def encode(tokenizer, text: str) -> Encoding:
    """The tokenizer's own encoding of ``text`` (no special tokens), with offsets."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return Encoding(list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])


def split_words(tokenizer, text: str, share: float, rng: random.Random | None) -> Encoding:
    """``text`` encoded with each word of four or more letters cut in two with probability
    ``share`` (one ``rng.random()`` per such word, one ``rng.randint`` per cut word; ``rng``
    is not used, and may be None, at ``share`` 0).

    A word is cut only where the tokenizer's own encoding spells it with tokens of its own
    (the first may carry the leading space) and the pieces decode to the same characters;
    any other word keeps its tokens.
    """
    enc = encode(tokenizer, text)
    if share <= 0:
        return enc
    if rng is None:
        raise ValueError("split_words: a share above 0 needs a random draw (rng)")
    ids, offsets, t = [], [], 0
    for word in CUTTABLE.finditer(text):
        if rng.random() >= share:
            continue
        cut = rng.randint(word.start() + 1, word.end() - 1)
        # byte-level BPE spells the leading space with the word's first token
        lo = word.start() - (word.start() > 0 and text[word.start() - 1] == " ")
        span = _word_tokens(enc, lo, word.end(), t)
        pieces = _cut_encoding(tokenizer, text, lo, cut, word.end()) if span else None
        if pieces is None:
            continue
        ids += enc.ids[t:span[0]] + pieces.ids
        offsets += enc.offsets[t:span[0]] + pieces.offsets
        t = span[1]
    return Encoding(ids + enc.ids[t:], offsets + enc.offsets[t:])


def _word_tokens(enc: Encoding, start: int, end: int, after: int) -> tuple[int, int] | None:
    """Token range ``[a, b)`` (from ``after`` on) that spells exactly the characters
    ``[start, end)`` (a word with its leading space), or None where tokens straddle its
    edges."""
    a = next((i for i in range(after, len(enc.ids)) if enc.offsets[i][1] > start), None)
    if a is None or enc.offsets[a][0] != start:
        return None
    b = a
    while b < len(enc.ids) and enc.offsets[b][1] <= end:
        b += 1
    return (a, b) if b > a and enc.offsets[b - 1][1] == end else None


def _cut_encoding(tokenizer, text: str, start: int, cut: int, end: int) -> Encoding | None:
    """``text[start:end]`` (a word, with its leading space if any) as two separately tokenized
    pieces split at ``cut``; None if they do not decode to those characters."""
    first = encode(tokenizer, text[start:cut])
    second = encode(tokenizer, text[cut:end])
    ids = first.ids + second.ids
    if tokenizer.decode(ids) != text[start:end]:
        return None
    return Encoding(ids, [(a + start, b + start) for a, b in first.offsets]
                    + [(a + cut, b + cut) for a, b in second.offsets])
