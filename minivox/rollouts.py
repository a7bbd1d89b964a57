"""Free-running rollouts: train the continuation after passages the model wrote by itself.

On long-form speech minivox's greedy transcripts leave the reference (a loop, invented text, a
skip) and its alignment layers follow the text off the audio; under teacher forcing the
transcript and the reading stay right to the end of a four-minute clip (docs/minivox.md,
"Where the long-form errors are"). Scheduled sampling (:mod:`kvsim.minivox.scheduled`) feeds
single teacher-forced greedy tokens, which are not the prefixes greedy decoding meets, and lost
on long-form speech at both shares tried.

A rollout feeds the true transcript up to a cut, lets the model write ``tokens`` tokens from
there by greedy decoding (no gradient, one KV cache for the whole example), and then goes on
with the reference from where the written passage leaves it (:func:`resume_index`): after the
last stretch the passage shares, in order, with the reference just after the cut, or at the
cut itself when it shares none (a loop re-reading earlier audio, invented text, a skip
further than the window: the words after the cut are still unread). The passage's own tokens
are inputs only (not scored, not guided); the continuation is scored against the reference
and, with the guided loss, its queries are pulled onto the audio of the words they write. So
the model is trained, on its own free-running prefixes, to find its place again and write
the words that are there. This is the DAgger-style "learning to recover" recipe (Ross et al.,
2011; for sequence models, the dynamic oracle of Goldberg & Nivre, 2012) with the oracle
given by espeak's word times.

Off by default (``TrainConfig.rollouts = 0``). Applied to batches of one example (the
long-form steps, ``p_concat``), where minivox fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from difflib import SequenceMatcher
from typing import TYPE_CHECKING, Protocol

import torch

from kvsim.hf import cache_keyword

from .guided import GuideTargets

if TYPE_CHECKING:
    from .train import Batch


def resume_index(reference: Sequence[int], cut: int, written: Sequence[int], window: int,
                 min_block: int = 2) -> int:
    """Index into ``reference`` of the token a continuation resumes at, after the model wrote
    ``written`` from ``reference[cut]`` on.

    The end of the last block of at least ``min_block`` tokens that ``written`` shares, in
    order, with ``reference[cut:cut + window]``; ``cut`` when it shares none.
    """
    segment = list(reference[cut:cut + window])
    blocks = SequenceMatcher(None, list(written), segment, autojunk=False).get_matching_blocks()
    ends = [b.b + b.size for b in blocks if b.size >= min_block]
    return cut + ends[-1] if ends else cut


def cut_points(word_start: torch.Tensor, count: int, tokens: int,
               generator: torch.Generator, first: int = 16) -> list[int]:
    """Up to ``count`` cut positions in a transcript, sorted: token indices where a word
    starts, at least ``first`` tokens in, ``tokens + 1`` before the end (the last token is the
    end token) and ``4 * tokens`` apart, drawn by ``generator``."""
    n = len(word_start)
    candidates = [i for i in range(first, n - tokens - 1) if bool(word_start[i])]
    chosen: list[int] = []
    for k in torch.randperm(len(candidates), generator=generator).tolist():
        if len(chosen) == count:
            break
        c = candidates[k]
        if all(abs(c - d) >= 4 * tokens for d in chosen):
            chosen.append(c)
    return sorted(chosen)


def begins_word(tokenizer):
    """``token_id -> bool``: whether the BPE token begins a word (a byte-level ``Ġ`` space
    first, as SmolLM2's tokenizer writes a word after a space)."""
    return lambda token: tokenizer.convert_ids_to_tokens(int(token)).startswith("Ġ")


class Writer(Protocol):
    """Greedy decoding over a transcript fed piece by piece (:class:`GreedyWriter`)."""

    def write(self, transcript: list[int], tokens: int) -> list[int]: ...


class GreedyWriter:
    """Greedy decoding of minivox's decoder after a prompt, with one KV cache per example.

    Parameters
    ----------
    model
        minivox (``model.model.language_model``, ``model.lm_head``,
        ``model.get_input_embeddings()``).
    prompt_embeds
        ``(1, p, d)`` the prompt's input embeddings, audio projected in.
    end_id
        The end token: writing stops before it.
    """

    def __init__(self, model, prompt_embeds: torch.Tensor, end_id: int) -> None:
        from transformers import DynamicCache

        self.model, self.end_id = model, end_id
        self.pending = prompt_embeds.detach()
        self.cache = DynamicCache()
        self.fed: list[int] = []
        self.cache_kw = cache_keyword(model.model.language_model)

    @torch.no_grad()
    def write(self, transcript: list[int], tokens: int) -> list[int]:
        """Feed what of ``transcript`` (the answer so far) is not yet in the cache, then write
        up to ``tokens`` tokens greedily (fewer when the end token comes first)."""
        if transcript[:len(self.fed)] != self.fed:
            raise ValueError("the transcript must extend what was fed before")
        table, decoder = self.model.get_input_embeddings(), self.model.model.language_model
        new = transcript[len(self.fed):]
        x = torch.cat([self.pending, table(torch.tensor([new], dtype=torch.long))
                       .to(self.pending.dtype)], dim=1)
        if x.shape[1] == 0:
            raise ValueError("nothing new to feed before writing")
        self.fed, self.pending = list(transcript), x[:, :0]
        written: list[int] = []
        while len(written) < tokens:
            out = decoder(inputs_embeds=x, use_cache=True, **{self.cache_kw: self.cache})
            token = int(self.model.lm_head(out.last_hidden_state[0, -1]).argmax())
            if token == self.end_id:
                break
            written.append(token)
            x = table(torch.tensor([[token]])).to(self.pending.dtype)
        # the cache holds every written token but the last one when all ``tokens`` were written
        self.fed += written if len(written) < tokens else written[:-1]
        return written


@dataclass(frozen=True)
class Rollout:
    """One written passage: the cut it starts at, what was written, where the reference resumes."""

    cut: int
    written: tuple[int, ...]
    resume: int


@dataclass(frozen=True)
class Answer:
    """A transcript with rollouts: its tokens, and for each the reference index it stands for
    (-1: a token the model wrote itself)."""

    tokens: list[int]
    reference_index: list[int]


def roll_out(reference: Sequence[int], cuts: Sequence[int], writer: Writer, tokens: int,
             window: int) -> tuple[Answer, list[Rollout]]:
    """The transcript ``reference`` (ending with the end token) with a passage written by
    ``writer`` at each cut; a cut before where the reference resumed is skipped."""
    out, index, rollouts, at = [], [], [], 0
    for cut in cuts:
        if cut <= at:
            continue
        out += reference[at:cut]
        index += range(at, cut)
        written = writer.write(list(out), tokens)
        at = resume_index(reference, cut, written, window)
        out += written
        index += [-1] * len(written)
        rollouts.append(Rollout(cut, tuple(written), at))
    out += reference[at:]
    index += range(at, len(reference))
    return Answer(list(out), index), rollouts


def rollout_batch(model, batch: Batch, word_start, count: int, tokens: int,
                  generator: torch.Generator, end_id: int,
                  writer: Writer | None = None) -> tuple[Batch, list[Rollout]]:
    """``batch`` (one example) with ``count`` free-running passages (:func:`roll_out`, a window
    of ``2 * tokens`` for :func:`resume_index`): the prompt's embeddings (the audio's with
    their gradient) kept, the answer re-embedded, the written tokens' predictions unscored and
    unguided, every reference token scored and guided as before.

    ``word_start(token_id) -> bool`` says whether a token begins a word (cuts fall there);
    ``writer``: the decoder to write with (default :class:`GreedyWriter` on ``model``).
    """
    if batch.labels.shape[0] != 1:
        raise ValueError(f"rollouts take a batch of one example, got {batch.labels.shape[0]}")
    labels = batch.labels[0]
    scored = torch.nonzero(labels != -100).flatten()
    p = int(scored[0]) + 1  # the query predicting answer token 0 sits at p - 1
    reference = labels[scored].tolist()
    starts = torch.tensor([word_start(t) for t in reference])
    cuts = cut_points(starts, count, tokens, generator)
    if not cuts:
        return batch, []
    if writer is None:
        writer = GreedyWriter(model, batch.embeds[:, :p], end_id)
    answer, rollouts = roll_out(reference, cuts, writer, tokens, 2 * tokens)
    table = model.get_input_embeddings()
    answer_embeds = table(torch.tensor([answer.tokens])).to(batch.embeds.dtype)
    embeds = torch.cat([batch.embeds[:, :p], answer_embeds], dim=1)
    index = torch.tensor(answer.reference_index)
    new_labels = torch.full((1, p + len(index)), -100, dtype=labels.dtype)
    new_labels[0, p - 1:p - 1 + len(index)] = torch.where(index >= 0, torch.tensor(answer.tokens), -100)
    guides = batch.guides
    if guides is not None and guides[0] is not None:
        guides = [rollout_guides(guides[0], index, p)]
    mask = torch.ones_like(new_labels, dtype=batch.mask.dtype)
    return replace(batch, embeds=embeds, mask=mask, labels=new_labels, guides=guides), rollouts


def rollout_guides(guide: GuideTargets, reference_index: torch.Tensor, p: int) -> GuideTargets:
    """The guided-loss targets after rollouts: the query predicting answer position i (at
    ``p - 1 + i``) keeps the span of the reference token it stands for, when that token had
    one (the end token's only with ``align_end``); written tokens have none."""
    guided = len(guide.spans)
    keep = (reference_index >= 0) & (reference_index < guided)
    positions = torch.nonzero(keep).flatten()
    source = reference_index[keep]
    weights = guide.weights[source] if guide.weights is not None else None
    return GuideTargets(p - 1 + positions, guide.audio_positions, guide.spans[source], weights)
