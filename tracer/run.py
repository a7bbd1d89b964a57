"""Trace one input: build the prompt, decode greedily while recording q/k(/v), lay out the
positions table and metadata of the trace contract (:mod:`kvsim.trace.schema`)."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvsim.core.shapes import HeadScores
from kvsim.trace import ModelFacts, TraceData, TraceMeta, positions_frame
from kvsim.trace.schema import OBSERVATION_WINDOW, observation_window
from kvsim.trace.writer import default_provenance
from kvsim.tracer.alignment import TokenAlignment
from kvsim.tracer.audio import AudioClip
from kvsim.tracer.backbones.base import Backbone, Prepared, PromptSpec
from kvsim.tracer.capture import Recorder, recording

FP16_MAX = 65504.0


@dataclass
class TraceOptions:
    """What to record and how to decode."""

    max_new_tokens: int = 256
    store_values: bool = False
    storage_dtype: str = "float16"  #: float16 or float32 (float16 falls back to float32 on overflow)
    min_new_tokens: int = 0  #: benchmarks: force a fixed answer length
    #: prompt positions whose queries are stored (the last ones; AudioKV's window, WnW App. F)
    observation_window: int = OBSERVATION_WINDOW
    prompt: PromptSpec = field(default_factory=PromptSpec)


@dataclass
class Generation:
    """A greedy decode and what the recorder captured during it."""

    prepared: Prepared
    tokens: list[int]  #: all generated tokens, the final one included
    tensors: dict[str, torch.Tensor]  #: keys/values (L,H_kv,N,D), queries (L,H_q,N_q,D), fp32
    prefill_s: float
    total_s: float
    window_start: int  #: first prompt position of the observation window

    @property
    def n_positions(self) -> int:
        return self.prepared.n_prompt + len(self.tokens) - 1

    @property
    def query_positions(self) -> np.ndarray:
        return np.arange(self.window_start, self.n_positions, dtype=np.int64)


def greedy_kwargs(max_new_tokens: int) -> dict[str, Any]:
    return {"do_sample": False, "num_beams": 1, "max_new_tokens": max_new_tokens,
            "temperature": None, "top_p": None, "top_k": None}


def generate_traced(backbone: Backbone, prepared: Prepared, options: TraceOptions,
                    on_step: Callable[[int], None] | None = None) -> Generation:
    """Greedy decoding with the recording attention active."""
    facts = backbone.facts()
    first_step: list[float] = []

    def step(i: int) -> None:
        if not first_step:
            first_step.append(time.perf_counter())
        if on_step is not None:
            on_step(i)

    window_start = observation_window(prepared.n_prompt, options.observation_window).start
    rec = Recorder(facts.n_layers, window_start, store_values=options.store_values,
                   on_step=step, decode_capacity=options.max_new_tokens)
    t0 = time.perf_counter()
    with torch.no_grad(), recording(rec):
        kw = greedy_kwargs(options.max_new_tokens)
        if options.min_new_tokens:
            kw["min_new_tokens"] = options.min_new_tokens
        out = backbone.model.generate(**prepared.inputs, **kw)
    _sync(backbone)
    total = time.perf_counter() - t0
    tokens = out[0, prepared.n_prompt:].tolist()
    if not tokens:
        raise RuntimeError("the model generated no token")
    want_calls = len(tokens)  # prefill + one decode step per fed generated token
    if rec.n_calls != want_calls:
        raise RuntimeError(
            f"recorded {rec.n_calls} attention calls per layer, expected {want_calls} "
            "(is the text decoder using the tracing attention?)"
        )
    tensors = rec.stacked(torch.float32)
    n = prepared.n_prompt + len(tokens) - 1
    if tensors["keys"].shape[2] != n:
        raise RuntimeError(f"recorded {tensors['keys'].shape[2]} key positions, expected {n}")
    prefill = (first_step[0] - t0) if first_step else total
    return Generation(prepared, tokens, tensors, prefill, total, window_start)


def _sync(backbone: Backbone) -> None:
    if backbone.device.type == "cuda":
        torch.cuda.synchronize(backbone.device)


def storage_dtype(tensors: dict[str, torch.Tensor], wanted: str) -> str:
    if wanted == "float16":
        peak = max(float(t.abs().max()) for t in tensors.values())
        if not np.isfinite(peak) or peak > FP16_MAX:
            return "float32"
    return wanted


def _positions_table(gen: Generation, alignment: TokenAlignment | None):
    """The per-position table of a generation: kinds, token ids, audio times, the words of the
    generated tokens (when aligned) and, when the processor says, which audio is padding."""
    import polars as pl

    p = gen.prepared
    n = gen.n_positions
    n_dec = len(gen.tokens) - 1
    kinds = list(p.kinds) + ["generated"] * n_dec
    token_ids = np.concatenate([p.input_ids, np.asarray(gen.tokens[:-1], dtype=np.int64)])
    a_start = np.full(n, np.nan)
    a_end = np.full(n, np.nan)
    a_start[p.audio_positions] = p.audio_start_s
    a_end[p.audio_positions] = p.audio_end_s
    words: list[str | None] = [None] * n
    w_start = np.full(n, np.nan)
    w_end = np.full(n, np.nan)
    conf = np.full(n, np.nan)
    if alignment is not None:
        for j in range(n_dec):  # generated token j sits at position n_prompt + j
            pos = p.n_prompt + j
            words[pos] = alignment.words[j]
            w_start[pos] = alignment.start_s[j]
            w_end[pos] = alignment.end_s[j]
            conf[pos] = alignment.confidence[j]
    positions = positions_frame(kinds, token_ids, gen.query_positions, a_start, a_end, words,
                                w_start, w_end)
    positions = positions.with_columns(
        pl.Series("word_confidence", [None if not np.isfinite(c) else float(c) for c in conf],
                  dtype=pl.Float64))
    if p.audio_padding is not None:
        padding = np.zeros(n, dtype=bool)
        padding[p.audio_positions] = p.audio_padding
        positions = positions.with_columns(pl.Series("padding", padding, dtype=pl.Boolean))
    return positions


def _provenance(backbone: Backbone, options: TraceOptions, gen: Generation,
                alignment: TokenAlignment | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    """Where a trace came from: versions, device, prompt settings, generation and timing."""
    import transformers

    n_dec = len(gen.tokens) - 1
    stopped = "eos" if gen.tokens[-1] in backbone.eos_ids else "max_new_tokens"
    prov = default_provenance()
    prov.update({
        "tracer": "kvsim.tracer",
        "model_path": backbone.path,
        "model_family": backbone.family,
        "processor": backbone.processor_note,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(backbone.device),
        "device_name": _device_name(backbone.device),
        "weights_dtype": backbone.options.dtype,
        "machine": platform.machine(),
        "task": options.prompt.task,
        "language": options.prompt.language,
        "max_new_tokens": options.max_new_tokens,
        "generation": {"token_ids": gen.tokens, "stopped": stopped},
        "timing": {"prefill_s": gen.prefill_s, "generate_s": gen.total_s,
                   "decode_tokens_per_s": (n_dec / max(gen.total_s - gen.prefill_s, 1e-9))},
    })
    if alignment is not None:
        prov["alignment"] = {"source": alignment.source, **alignment.info}
    if extra:
        prov.update(extra)
    return prov


def build_trace(backbone: Backbone, clip: AudioClip, gen: Generation, options: TraceOptions,
                alignment: TokenAlignment | None, reference_text: str | None,
                head_scores: HeadScores | None = None, extra: dict[str, Any] | None = None,
                ) -> TraceData:
    """Lay out the trace of one generation (see the contract in :mod:`kvsim.trace.schema`)."""
    p = gen.prepared
    n = gen.n_positions
    n_dec = len(gen.tokens) - 1
    dtype = storage_dtype(gen.tensors, options.storage_dtype)
    facts: ModelFacts = backbone.facts(dtype)
    positions = _positions_table(gen, alignment)
    text = backbone.decode(gen.tokens)
    prov = _provenance(backbone, options, gen, alignment, extra)
    audio = {
        "path": str(clip.path), "duration_s": clip.duration_s, "sample_rate": clip.sample_rate,
        "source_sample_rate": clip.source_rate, "source_channels": clip.source_channels,
        "n_audio_tokens": int(len(p.audio_positions)),
        "first_audio_position": int(p.audio_positions[0]) if len(p.audio_positions) else None,
        "n_padding_tokens": None if p.audio_padding is None else int(p.audio_padding.sum()),
        **p.audio,
    }
    meta = TraceMeta(model=facts, n_positions=n, n_prefill=p.n_prompt, n_decode=n_dec,
                     prompt=p.prompt_text, generated_text=text, reference_text=reference_text,
                     audio=audio, provenance=prov)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    t = gen.tensors
    return TraceData(
        meta=meta,
        keys=t["keys"].numpy().astype(np_dtype),
        queries=t["queries"].numpy().astype(np_dtype),
        query_positions=gen.query_positions,
        positions=positions,
        values=t["values"].numpy().astype(np_dtype) if "values" in t else None,
        head_scores=head_scores,
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"
