"""What an input transform returns, and how it is spliced into a prompt."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SpanTransform:
    """A rewritten audio span: new embeddings and, per new position, its kind and times.

    ``kinds`` is ``audio`` (an original or pooled audio token) or ``anchor`` (VoxZip semantic
    anchor: pooled audio + a text embedding). ``source`` maps every new position to the
    half-open range of original audio indices it summarises, in order.
    """

    embeds: torch.Tensor  #: (m, d)
    kinds: list[str]
    start_s: np.ndarray  #: (m,)
    end_s: np.ndarray  #: (m,)
    source: list[tuple[int, int]]

    def __post_init__(self) -> None:
        m = self.embeds.shape[0]
        if not (len(self.kinds) == len(self.start_s) == len(self.end_s) == len(self.source) == m):
            raise ValueError("span transform: embeds, kinds, times and source must have one entry per position")

    @property
    def retention(self) -> float:
        """New span length / original span length."""
        n = self.source[-1][1] if self.source else 0
        return len(self.kinds) / max(n, 1)


def splice(prompt, span: SpanTransform, full_embeds: torch.Tensor, name: str,
           padding: np.ndarray | None = None):
    """A copy of ``prompt`` whose audio span is replaced by ``span`` (prefill from
    ``inputs_embeds``); ``padding`` marks which new positions are encoder padding (None: not
    known, as when a pooled token may mix padding and speech)."""
    import dataclasses

    a = prompt.audio_positions
    a0, a1 = int(a[0]), int(a[-1]) + 1
    if a1 - a0 != len(a):
        raise ValueError("input transforms need one contiguous audio span")
    emb = torch.cat([full_embeds[:, :a0], span.embeds[None].to(full_embeds.dtype), full_embeds[:, a1:]], dim=1)
    m = span.embeds.shape[0]
    return dataclasses.replace(
        prompt,
        inputs_embeds=emb,
        n_prompt=emb.shape[1],
        audio_positions=np.arange(a0, a0 + m),
        audio_start_s=np.asarray(span.start_s, dtype=np.float64),
        audio_end_s=np.asarray(span.end_s, dtype=np.float64),
        transform=name,
        original_n_audio=prompt.original_n_audio or len(a),
        span_kinds=list(span.kinds),
        audio_padding=None if padding is None else np.asarray(padding, dtype=bool),
    )
