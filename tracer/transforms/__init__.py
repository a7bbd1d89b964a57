"""Input transforms: rewrite the audio span of the decoder's input embeddings before prefill.

Each transform is a function ``(audio_embeds, audio times, ...) -> SpanTransform`` (new
embeddings, per-position kinds and times, order preserved); :func:`splice` puts the result
back into a prompt. Used by ``kvsim live --transform`` (and by ``kvsim trace`` later).

* ``voxzip1`` -- VoxZip stage 1 semantic anchors (:mod:`kvsim.tracer.transforms.voxzip_anchors`);
* ``affpool[:retention]`` -- affinity pooling of adjacent audio tokens
  (:mod:`kvsim.tracer.transforms.affpool`), default retention 0.5: the input-level variant,
  on the input embeddings, threshold bisected per clip;
* ``nopad`` -- the audio tokens a Whisper-style encoder made from the zeros that fill its
  last 30 s window are taken out of the input, so the decoder never sees them (the backbone
  must say which tokens are padding: ``LivePrompt.audio_padding``);
* ``affpool_layers:τ`` -- WnW App. F's AffPool inside the decoder (pooling at the output of
  the first layers, :mod:`kvsim.tracer.transforms.affpool_layers`) with threshold τ, set on
  a held-out subset by :func:`~kvsim.tracer.transforms.affpool_layers.calibrate_layer_threshold`
  (runs with policy ``full``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvsim.tracer.transforms.affpool import affpool
from kvsim.tracer.transforms.base import SpanTransform, splice
from kvsim.tracer.transforms.voxzip_anchors import semantic_anchors, whisper_segments

__all__ = ["SpanTransform", "affpool", "semantic_anchors", "splice", "parse_transforms"]


def _audio_span(lm, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    full = lm.embed(prompt)
    a = prompt.audio_positions
    return full, full[0, int(a[0]) : int(a[-1]) + 1]


def affpool_transform(retention: float) -> Callable[..., Any]:
    def apply(lm, prompt, audio):
        full, span = _audio_span(lm, prompt)
        out = affpool(span, prompt.audio_start_s, prompt.audio_end_s, retention=retention)
        return splice(prompt, out, full, f"affpool:{retention:g}")
    return apply


def affpool_layers_transform(threshold: float, name: str) -> Callable[..., Any]:
    def apply(lm, prompt, audio):
        import dataclasses

        from kvsim.tracer.transforms.affpool_layers import LayerPoolConfig

        return dataclasses.replace(prompt, layer_pool=LayerPoolConfig(threshold),
                                   transform=name)
    return apply


def voxzip1_transform(segment_fn: Callable[..., Any] = whisper_segments) -> Callable[..., Any]:
    def apply(lm, prompt, audio):
        full, span = _audio_span(lm, prompt)
        segs = segment_fn(audio)
        out = semantic_anchors(span, prompt.audio_start_s, prompt.audio_end_s, segs, lm.text_embeddings)
        return splice(prompt, out, full, "voxzip1")
    return apply


def nopad_transform() -> Callable[..., Any]:
    """The ``nopad`` transform: drop the padding positions of the audio span, keep the rest."""
    def apply(lm, prompt, audio):
        if prompt.audio_padding is None:
            raise ValueError(f"--transform nopad: {lm.name} does not say which audio tokens "
                             "are padding")
        keep = np.flatnonzero(~np.asarray(prompt.audio_padding, dtype=bool))
        if len(keep) == 0:
            raise ValueError("--transform nopad: every audio token is padding")
        full, span = _audio_span(lm, prompt)
        out = SpanTransform(span[torch.as_tensor(keep, device=span.device)], ["audio"] * len(keep),
                            prompt.audio_start_s[keep], prompt.audio_end_s[keep],
                            [(int(i), int(i) + 1) for i in keep])
        return splice(prompt, out, full, "nopad", padding=np.zeros(len(keep), dtype=bool))
    return apply


def parse_transforms(text: str) -> dict[str, Callable[..., Any] | None]:
    """``"none,voxzip1,affpool:0.5"`` -> name -> transform (None = untouched input)."""
    out: dict[str, Callable[..., Any] | None] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, arg = item.partition(":")
        if name == "none":
            out["none"] = None
        elif name == "voxzip1":
            out["voxzip1"] = voxzip1_transform()
        elif name == "nopad":
            out["nopad"] = nopad_transform()
        elif name == "affpool":
            try:
                r = float(arg) if arg else 0.5
            except ValueError:
                raise ValueError(f"--transform {item!r}: retention must be a number") from None
            out[f"affpool:{r:g}"] = affpool_transform(r)
        elif name == "affpool_layers":
            try:
                tau = float(arg)
            except ValueError:
                raise ValueError(f"--transform {item!r}: give the affinity threshold, "
                                 "affpool_layers:TAU") from None
            out[item] = affpool_layers_transform(tau, item)  # keyed as given: τ is calibrated
        else:
            raise ValueError(f"--transform {item!r}: unknown; use none, voxzip1, "
                             "affpool[:retention], affpool_layers:TAU, nopad")
    if not out:
        raise ValueError("--transform: nothing given")
    return out
