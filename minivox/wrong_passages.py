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
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .train import Batch


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


def wrong_passage_batch(model, batch: Batch, share: float, length: int,
                        generator: torch.Generator) -> Batch:
    """``batch`` with about ``share`` of each row's transcript inputs replaced, in blocks of
    ``length`` tokens, by distant stretches of the same transcript (:func:`passage_sources`);
    labels, mask and guides unchanged. Returns ``batch`` itself when nothing is replaced."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"wrong_share must be in [0, 1], got {share}")
    if length < 1:
        raise ValueError(f"wrong_length must be >= 1, got {length}")
    if share == 0.0:
        return batch
    mixable = replaceable(batch.labels)
    embeds = None
    table = model.get_input_embeddings()
    for row in range(batch.labels.shape[0]):
        positions = torch.nonzero(mixable[row]).flatten()
        # the input at position k is the transcript token labelled at position k - 1
        tokens = batch.labels[row, positions - 1]
        for start, source in passage_sources(len(positions), length, share, generator):
            if embeds is None:
                embeds = batch.embeds.clone()
            wrong = tokens[source:source + length]
            embeds[row, positions[start:start + length]] = table(wrong).to(embeds.dtype)
    return batch if embeds is None else replace(batch, embeds=embeds)
