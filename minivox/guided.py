"""Alignment-guided attention: a training loss that keeps the decoder reading in order.

minivox's decoder layers 20-23 align: the attention of each answer token peaks on the audio of
the word being written (docs/minivox.md, "What limited it"). On long audio that peak jumps
back and forward and skips speech. espeak gives every word's exact audio interval, so training
can say where the peak belongs: for the query that predicts an answer token, the share of the
layer's audio attention (averaged over its query heads, renormalised over the audio positions)
that falls inside the audio interval of the word the token belongs to, widened by a margin.
The loss is the mean negative log of that share over the scored tokens and the guided layers,

    L_align = - mean_{layer, token} log( sum_{a in span(token) +- margin} p_layer(a | token) ),

added to the transcript cross-entropy with a weight (``TrainConfig.align_weight``; 0, the
default, trains as before). This is the guided-attention idea of TTS training (a prior that
the text-audio attention is near-diagonal), made exact with known word times.

The probe recomputes the guided layers' queries and keys from the layer's input (the same
projections, LoRA included, and the same rotary embedding), only for the scored answer rows and
the audio columns, so the model's own attention kernel (SDPA) is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

#: Audio tokens per second of audio: 375 per 30 s window (Whisper's 1500 frames stacked by 4).
TOKENS_PER_SECOND = 12.5
def word_char_spans(text: str, words: Sequence[str]) -> list[tuple[int, int]]:
    """Character span of each word of ``words`` in ``text``, found left to right.

    ``words`` are the manifest's words: the text's words in order, punctuation stripped.

    Raises
    ------
    ValueError
        If a word is not found after the previous one.
    """
    spans, pos = [], 0
    for w in words:
        i = text.find(w, pos)
        if i < 0:
            raise ValueError(f"word {w!r} not found in the text after character {pos}")
        spans.append((i, i + len(w)))
        pos = i + len(w)
    return spans


def token_words(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """The word each BPE token belongs to: index into ``spans``, per token.

    A token belongs to the word its characters overlap; a token that overlaps none (a
    punctuation mark or a space) belongs to the last word that starts before it (it is written
    right after that word), or to the first word if none does.
    """
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    a = np.array([o[0] for o in offsets], dtype=np.int64)
    b = np.array([o[1] for o in offsets], dtype=np.int64)
    # words are in order and disjoint: the first word ending after a token's start overlaps
    # it if that word also starts before the token's end
    first = np.searchsorted(ends, a, side="right")
    hit = first < len(spans)
    hit[hit] &= starts[first[hit]] < b[hit]
    before = np.maximum(np.searchsorted(starts, a, side="right") - 1, 0)
    return np.where(hit, first, before).astype(np.int64)


def part_word_times(row: dict, part_tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Word start/end in audio tokens of an example (a manifest row or a joined row).

    The parts of a joined row are played back to back, each in its own whole number of 30 s
    windows; ``part_tokens`` are the audio tokens of each part (its encoder windows x 375), so
    a word's token index is the tokens of the parts before it plus ``time x 12.5``.
    """
    parts = row.get("parts", [row])
    if len(parts) != len(part_tokens):
        raise ValueError(f"{len(parts)} parts but {len(part_tokens)} token counts")
    starts, ends, words, offset = [], [], [], 0
    for p, n in zip(parts, part_tokens, strict=True):
        starts.append(offset + np.asarray(p["word_start"], dtype=np.float64) * TOKENS_PER_SECOND)
        ends.append(offset + np.asarray(p["word_end"], dtype=np.float64) * TOKENS_PER_SECOND)
        words.extend(p["words"])
        offset += int(n)
    return np.concatenate(starts), np.concatenate(ends), words


def target_spans(tokenizer, row: dict, part_tokens: Sequence[int], margin_s: float,
                 guide_end: bool = False, offsets: Sequence[tuple[int, int]] | None = None,
                 ) -> np.ndarray:
    """``(n_tokens, 2)`` audio-token interval ``[lo, hi)`` of each transcript BPE token.

    ``offsets``: the character span of each token the trainer scores (e.g. a
    :func:`~kvsim.minivox.subword.split_words` encoding); None: those of
    ``tokenizer(row["text"])``, which must then give the tokens the trainer scores. The interval is
    the token's word, widened by ``margin_s`` seconds on each side. With ``guide_end`` one more
    row guides the query that predicts the end token: from the last word's end (less the
    margin) to the end of the speech (:func:`speech_end`), the tail of the audio a reader has
    reached when the transcript is complete.
    """
    if offsets is None:
        offsets = tokenizer(row["text"], add_special_tokens=False,
                            return_offsets_mapping=True)["offset_mapping"]
    start, end, words = part_word_times(row, part_tokens)
    tw = token_words(offsets, word_char_spans(row["text"], words))
    m = margin_s * TOKENS_PER_SECOND
    lo = np.floor(start[tw] - m).clip(min=0)
    hi = np.ceil(end[tw] + m)
    if guide_end:
        lo = np.append(lo, max(np.floor(end[-1] - m), 0))
        hi = np.append(hi, np.ceil(speech_end(row, part_tokens)))
    return np.stack([lo, np.maximum(hi, lo + 1)], axis=1).astype(np.int64)


def speech_end(row: dict, part_tokens: Sequence[int]) -> float:
    """Where the example's audio ends, in audio tokens: the last part's duration after the
    windows of the parts before it (the zero padding of the last window excluded)."""
    parts = row.get("parts", [row])
    return float(sum(part_tokens[:-1]) + parts[-1]["duration"] * TOKENS_PER_SECOND)


@dataclass
class GuideTargets:
    """Where the guided loss looks in one batch row."""

    query_positions: torch.Tensor  #: (R,) sequence positions of the queries that predict tokens
    audio_positions: torch.Tensor  #: (A,) sequence positions of the audio tokens, in order
    spans: torch.Tensor  #: (R, 2) audio-token interval [lo, hi) per query (indices into A)
    #: (R,) weight of each query's term (None: all 1); the loss stays a mean over the R queries
    weights: torch.Tensor | None = None


class AttentionProbe:
    """Captures the input of chosen decoder layers' self-attention during a forward pass.

    Parameters
    ----------
    language_model
        A transformers Llama-style decoder (``.layers[i].self_attn`` with ``q_proj``,
        ``k_proj``, ``head_dim``, ``scaling``).
    layers
        The decoder layers to guide.
    """

    def __init__(self, language_model: torch.nn.Module, layers: Sequence[int]) -> None:
        self.attn = {i: language_model.layers[i].self_attn for i in layers}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @contextmanager
    def capture(self) -> Iterator[AttentionProbe]:
        """Record the layers' inputs for the forward passes run inside the block."""
        handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                   for i, m in self.attn.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            self.inputs[layer] = (hidden, cos, sin)
        return hook

    def audio_attention(self, layer: int, row: int, target: GuideTargets) -> torch.Tensor:
        """``(R, A)`` head-mean attention of the scored queries over the audio, renormalised.

        The same softmax the layer computes, restricted to the audio columns (every audio
        position precedes every answer query, so the causal mask keeps them all).
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.attn[layer]
        hidden, cos, sin = self.inputs[layer]
        qp, ap = target.query_positions, target.audio_positions
        d = attn.head_dim
        q = attn.q_proj(hidden[row, qp]).view(1, len(qp), -1, d).transpose(1, 2)
        k = attn.k_proj(hidden[row, ap]).view(1, len(ap), -1, d).transpose(1, 2)
        b = row if cos.shape[0] > 1 else 0  # rotary tables are shared by the batch or per row
        q, _ = apply_rotary_pos_emb(q, q, cos[b:b + 1, qp], sin[b:b + 1, qp])
        _, k = apply_rotary_pos_emb(k, k, cos[b:b + 1, ap], sin[b:b + 1, ap])
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 under autocast: fp32 here
        with torch.autocast(q.device.type, enabled=False):
            logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * attn.scaling
            return logits.softmax(-1)[0].mean(0)


def span_loss(prob: torch.Tensor, spans: torch.Tensor,
              weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean ``-log`` of the attention mass inside each row's span: ``prob`` (R, A), spans (R, 2);
    with ``weights`` (R,) each row's term is multiplied by its weight before the mean over R."""
    cols = torch.arange(prob.shape[1], device=prob.device)
    inside = (cols >= spans[:, :1]) & (cols < spans[:, 1:])
    mass = (prob * inside).sum(-1)
    per_row = -torch.log(mass.clamp_min(torch.finfo(prob.dtype).tiny))
    if weights is not None:
        per_row = per_row * weights.to(per_row.dtype)
    return per_row.mean()


def is_guided(target: GuideTargets | None) -> bool:
    """Whether a batch row has guided-attention targets (at least one guided query)."""
    return target is not None and len(target.query_positions) > 0


def guided_loss(probe: AttentionProbe, targets: Sequence[GuideTargets | None]) -> torch.Tensor:
    """:func:`span_loss` averaged over the probe's layers and the batch rows that have targets."""
    losses = [span_loss(probe.audio_attention(layer, i, t), t.spans, t.weights)
              for layer in probe.attn for i, t in enumerate(targets) if is_guided(t)]
    if not losses:
        raise ValueError("no batch row has guided-attention targets")
    return torch.stack(losses).mean()
