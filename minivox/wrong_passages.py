"""Wrong passages: train on transcript prefixes that leave the reference for a stretch of tokens.

On long-form speech minivox's greedy transcripts go wrong for a few tokens, then its
alignment layers jump and the text resumes later in the audio, skipping a passage; fed a wrong
passage under teacher forcing, its reading runs away from the audio of the words it replaced
and the tokens after it are read and predicted worse (docs/minivox.md, "Where the long-form
errors are"). Teacher forcing never shows it a wrong prefix, and scheduled sampling
(:mod:`kvsim.minivox.scheduled`) shows it single tokens of its own.

This augmentation replaces blocks of consecutive transcript inputs by the tokens of a distant
stretch of the same transcript (text that is fluent and on topic, but not what is spoken there:
what a loop re-reads or a skip jumps to), and keeps the labels and the guided-attention
targets: the model learns to keep reading the audio of the true words while its prefix is
wrong, and to write those words. No first pass is needed. Off by default
(``TrainConfig.wrong_share = 0``).

Two variants (``TrainConfig.wrong_source``, ``wrong_guide_weight``): the blocks can come from
*other* transcripts (a pool of training text, :func:`text_pool`) instead, text never spoken
in the clip, so that no place in the audio matches it and jumping there cannot pay; and the
guided loss on the queries that see a wrong block, the block's own and the ``length`` after it,
can be weighted up, so that keeping one's place through it is what the loss asks for most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .guided import GuideTargets

if TYPE_CHECKING:
    from .train import Batch

#: Where the wrong blocks come from: the same transcript, or other transcripts (a text pool).
SOURCES = ("same", "other")


def text_pool(tokenizer, texts: Sequence[str], generator: torch.Generator,
              max_texts: int = 2000) -> torch.Tensor:
    """(T,) token ids of up to ``max_texts`` of ``texts`` (drawn by ``generator``), joined with
    spaces: the text the ``"other"`` source cuts its wrong blocks from."""
    if not texts:
        raise ValueError("wrong passages from other transcripts need training text: none given")
    order = torch.randperm(len(texts), generator=generator)[:max_texts].tolist()
    ids = tokenizer(" ".join(texts[i] for i in order), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def replaceable(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the input positions that hold a transcript token feeding a scored
    prediction (the label of the position before, and a label here): never the prompt, the
    audio, the first transcript token's query or the end token."""
    scored = labels != -100
    out = torch.zeros_like(scored)
    out[:, 1:] = scored[:, :-1] & scored[:, 1:]
    return out


def passage_sources(n: int, length: int, share: float, generator: torch.Generator
                    ) -> list[tuple[int, int]]:
    """(start, source) of the wrong passages of one transcript of ``n`` replaceable inputs:
    about ``share * n / length`` non-overlapping blocks of ``length`` tokens, each to be
    replaced by the ``length`` tokens from ``source``, at least ``2 * length`` tokens away
    (earlier or later in the same transcript). Empty when the transcript is too short."""
    if n < 3 * length:
        return []
    count = round(share * n / length)
    taken = torch.zeros(n, dtype=torch.bool)
    out = []
    for start in torch.randperm(n - length + 1, generator=generator).tolist():
        if len(out) == count:
            break
        if taken[start:start + length].any():
            continue
        far = [s for s in range(n - length + 1) if abs(s - start) >= 2 * length]
        if not far:
            continue
        source = far[int(torch.randint(len(far), (1,), generator=generator))]
        taken[start:start + length] = True
        out.append((start, source))
    return sorted(out)


def weighted_guides(guide: GuideTargets | None, affected: torch.Tensor,
                    weight: float) -> GuideTargets | None:
    """``guide`` with weight ``weight`` on the queries at the sequence positions ``affected``
    (1 elsewhere, or the weights it had); ``guide`` itself when there is nothing to weight."""
    if guide is None or weight == 1.0 or not len(affected):
        return guide
    weights = (guide.weights.clone() if guide.weights is not None
               else torch.ones(len(guide.query_positions)))
    weights[torch.isin(guide.query_positions, affected)] = weight
    return replace(guide, weights=weights)


def wrong_passage_batch(model, batch: Batch, share: float, length: int,
                        generator: torch.Generator, pool: torch.Tensor | None = None,
                        guide_weight: float = 1.0) -> Batch:
    """``batch`` with about ``share`` of each row's transcript inputs replaced, in blocks of
    ``length`` tokens, by distant stretches of the same transcript (:func:`passage_sources`),
    or with a ``pool`` (:func:`text_pool`) by ``length`` tokens cut from it at random; labels
    and mask unchanged, and the guides too unless ``guide_weight`` != 1: then the guided loss
    of the queries at each block and the ``length`` positions after it is weighted by it.
    Returns ``batch`` itself when nothing is replaced."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"wrong_share must be in [0, 1], got {share}")
    if length < 1:
        raise ValueError(f"wrong_length must be >= 1, got {length}")
    if pool is not None and len(pool) < length:
        raise ValueError(f"the text pool has {len(pool)} tokens, fewer than one block of {length}")
    if share == 0.0:
        return batch
    mixable = replaceable(batch.labels)
    reweigh = batch.guides is not None and guide_weight != 1.0
    embeds, guides = None, list(batch.guides) if reweigh else None
    table = model.get_input_embeddings()
    for row in range(batch.labels.shape[0]):
        positions = torch.nonzero(mixable[row]).flatten()
        # the input at position k is the transcript token labelled at position k - 1
        tokens = batch.labels[row, positions - 1]
        affected = []
        for start, source in passage_sources(len(positions), length, share, generator):
            if embeds is None:
                embeds = batch.embeds.clone()
            if pool is None:
                wrong = tokens[source:source + length]
            else:
                cut = int(torch.randint(len(pool) - length + 1, (1,), generator=generator))
                wrong = pool[cut:cut + length]
            embeds[row, positions[start:start + length]] = table(wrong).to(embeds.dtype)
            if reweigh:
                first = int(positions[start])
                affected.append(torch.arange(first, first + 2 * length))
        if affected:
            guides[row] = weighted_guides(guides[row], torch.cat(affected), guide_weight)
    if embeds is None:
        return batch
    return replace(batch, embeds=embeds, guides=guides if reweigh else batch.guides)
