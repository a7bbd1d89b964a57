"""Apply an input transform to a :class:`kvsim.tracer.backbones.Prepared` (for ``kvsim trace
--input-transform``): the same transforms as ``kvsim live --transform``, returning a Prepared
whose ``inputs`` are ``{"inputs_embeds", "attention_mask"}`` and whose audio span, kinds, token
ids (audio placeholders) and times describe the rewritten span.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def transform_prepared(backbone, prepared, audio: np.ndarray, name: str):
    """Rewrite ``prepared``'s audio span with transform ``name`` (``voxzip1``, ``affpool:r``).

    Returns ``(new_prepared, span)`` where ``span`` is the :class:`SpanTransform` (kinds
    ``audio``/``anchor`` and the original-token ranges each new position summarises).
    """
    from kvsim.live.models import LivePrompt, TracerLive
    from kvsim.tracer.transforms import parse_transforms

    fn = parse_transforms(name)[name]
    if fn is None:
        return prepared, None
    live = TracerLive.__new__(TracerLive)  # wrap the already-loaded backbone
    live.bb, live.model, live.tokenizer = backbone, backbone.model, backbone.tokenizer
    live.name, live.family = backbone.name, backbone.family
    live.audio_tokens_per_s, live.sample_rate = float(backbone.audio_tokens_per_s), int(backbone.sample_rate)
    n_a = len(prepared.audio_positions)
    prompt = LivePrompt(
        model_inputs=dict(prepared.inputs), n_prompt=prepared.n_prompt,
        audio_positions=np.asarray(prepared.audio_positions), audio_start_s=np.asarray(prepared.audio_start_s),
        audio_end_s=np.asarray(prepared.audio_end_s), duration_s=len(audio) / live.sample_rate,
        original_n_audio=n_a, span_kinds=["audio"] * n_a, audio_padding=prepared.audio_padding)
    out = fn(live, prompt, audio)
    if out.layer_pool is not None:
        raise ValueError(f"--input-transform {name}: in-layer AffPool pools inside the decoder, "
                         "not the input; it runs in `kvsim live` only")
    a0, a1 = int(prepared.audio_positions[0]), int(prepared.audio_positions[-1]) + 1
    m = out.n_audio
    ids = np.concatenate([prepared.input_ids[:a0], np.full(m, backbone.audio_token_id, dtype=np.int64),
                          prepared.input_ids[a1:]])
    kinds = list(prepared.kinds[:a0]) + ["audio"] * m + list(prepared.kinds[a1:])
    mask = torch.ones((1, out.n_prompt), dtype=torch.long, device=out.inputs_embeds.device)
    new = dataclasses.replace(
        prepared, inputs={"inputs_embeds": out.inputs_embeds, "attention_mask": mask}, input_ids=ids,
        kinds=kinds, audio_positions=out.audio_positions, audio_start_s=out.audio_start_s,
        audio_end_s=out.audio_end_s, audio_padding=out.audio_padding,
        audio={**prepared.audio, "input_transform": name, "span_kinds": out.span_kinds,
               "original_n_audio": n_a})
    return new, out
