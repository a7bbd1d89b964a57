"""Parallel scheduled sampling: train on transcript prefixes that hold the model's own errors.

Teacher forcing trains every transcript token on the true prefix, while greedy decoding feeds
the model its own output, errors included (exposure bias). On long-form speech minivox's
teacher-forced loss is as low late in a clip as early, yet its greedy transcripts skip whole
passages (docs/minivox.md, "Where the long-form errors are"): a prefix that no longer matches
the audio loses the read position. Parallel scheduled sampling (Duckworth et al., 2019,
"Parallel Scheduled Sampling"; Mihaylova & Martins, 2019, "Scheduled Sampling for
Transformers") runs a first teacher-forced pass without gradients, replaces a random share of
the transcript's input tokens by that pass's greedy predictions and trains the second pass on
the mixed prefix against the true labels. Off by default (``TrainConfig.sampled_share = 0``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .train import Batch


def sampled_positions(labels: torch.Tensor, share: float,
                      generator: torch.Generator) -> torch.Tensor:
    """(B, L) bool: the input positions whose teacher token is replaced.

    An input position k can be replaced when its token is a transcript token (the label of
    position k - 1) that feeds a scored prediction (position k has a label): never the prompt,
    the audio, the first transcript token's query or the end token. Each such position is
    drawn with probability ``share`` (the draw covers the whole (B, L) grid, so it depends on
    the generator's state and the shape only).
    """
    scored = labels != -100
    mixable = torch.zeros_like(scored)
    mixable[:, 1:] = scored[:, :-1] & scored[:, 1:]
    return mixable & (torch.rand(labels.shape, generator=generator) < share)


@torch.no_grad()
def greedy_predictions(model, batch: Batch) -> torch.Tensor:
    """(B, L) long: the teacher-forced greedy token at every scored position, -1 elsewhere."""
    from .train import scored_logits  # train imports this module

    pred = torch.full_like(batch.labels, -1)
    pred[batch.labels != -100] = scored_logits(model, batch).argmax(-1)
    return pred


def mixed_batch(model, batch: Batch, share: float, generator: torch.Generator) -> Batch:
    """``batch`` with a ``share`` of its transcript inputs replaced by the model's greedy
    predictions for them (:func:`sampled_positions`); labels, mask and guides unchanged.

    The input at position k is the token predicted at k - 1, so a replaced input is what
    greedy decoding would have fed there after a correct prefix. Returns ``batch`` itself
    when no position is drawn (no first pass).
    """
    positions = sampled_positions(batch.labels, share, generator)
    if not positions.any():
        return batch
    pred = greedy_predictions(model, batch)
    source = torch.zeros_like(positions)
    source[:, :-1] = positions[:, 1:]  # row-major: the same order as ``positions``
    embeds = batch.embeds.clone()
    table = model.get_input_embeddings()
    embeds[positions] = table(pred[source]).to(embeds.dtype)
    return replace(batch, embeds=embeds)
