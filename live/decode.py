"""Greedy live decoding with a policy in the loop, and plain greedy decoding to compare with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import torch

from kvsim.core.steplog import STEP_LOG_COLUMNS, RunFacts, retention_per_step
from kvsim.decoding.cycle_ban import CycleBan, CycleBanConfig
from kvsim.decoding.hold_end import HoldEnd, check_hold_end, speech_tokens_of
from kvsim.decoding.processors import OptionProcessors
from kvsim.decoding.read_window import ReadWindow, ReadWindowConfig
from kvsim.live.attention import ACTIVE, LIVE_ATTN
from kvsim.live.models import LiveModel, LivePrompt
from kvsim.live.offload import install_offload
from kvsim.live.session import LiveSession
from kvsim.policies.base import HeadScores, PolicyContext
from kvsim.policies.spec import PolicySpec
from kvsim.trace.schema import OBSERVATION_WINDOW


@dataclass
class LiveConfig:
    """How to decode.

    Parameters
    ----------
    max_new_tokens : int
        Generation stops after this many tokens (the run then counts as not terminated).
    physical : bool
        Physical offload path (:mod:`kvsim.live.offload`) instead of masking emulation.
    head_scores : HeadScores or None
        Calibration scores for WnW / AudioKV.
    check_invariants : bool
        Check the protocol invariants at every step.
    seed : int
        Seed handed to policies.
    """

    max_new_tokens: int = 200
    physical: bool = False
    head_scores: HeadScores | None = None
    check_invariants: bool = True
    seed: int = 0
    record_tiers: bool = False  #: keep the tiers after prefill and after every step
    #: prompt positions whose queries the prefill view sees (AudioKV's window, WnW App. F)
    observation_window: int = OBSERVATION_WINDOW
    #: a policy that can (ArkVale) selects on the model's device, no host read per layer
    #: (masking path); False: ``select`` in NumPy on the host, the query copied there; None
    #: (default): on the device when the model is not on the CPU (on the CPU there is no
    #: host round trip to save, and NumPy selects faster than small torch operations)
    device_select: bool | None = None
    #: decoding options, not the papers' protocol (None: off): the read window on the aligning
    #: layers (:mod:`kvsim.decoding.read_window`), the cycle ban (:mod:`kvsim.decoding.cycle_ban`)
    #: and, with the window, the end of answer held until the read position is within this many
    #: seconds of the end of the speech (:mod:`kvsim.decoding.hold_end`)
    read_window: ReadWindowConfig | None = None
    ban_cycles: CycleBanConfig | None = None
    hold_end: float | None = None

    def __post_init__(self) -> None:
        check_hold_end(self.hold_end, self.read_window)

    def decoding_options(self) -> dict[str, str]:
        """The decoding options that are on, as their command-line values (keys:
        :data:`kvsim.decoding.OPTION_KEYS`); empty for the papers' plain greedy decoding."""
        on = {"read_window": self.read_window, "ban_cycles": self.ban_cycles}
        specs = {key: value.spec() for key, value in on.items() if value is not None}
        if self.hold_end is not None:
            specs["hold_end"] = f"{self.hold_end:g}"
        return specs


@dataclass
class LiveRun:
    """Outcome of one (input, policy, budget) live run."""

    spec: PolicySpec
    tokens: list[int]
    text: str
    terminated: bool
    summary: dict[str, Any]
    step_log: pl.DataFrame
    facts: RunFacts
    tiers_after_prefill: np.ndarray | None = None
    tiers: list[np.ndarray] | None = None  #: with ``record_tiers``: after prefill, after each step
    step_attention: list[np.ndarray] | None = None  #: with ``record_tiers``: StepView buffers
    #: with a read window: ``read_windows``, the [lo, hi) audio window of each decode step
    extra: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kw(model: Any, cache: Any) -> dict[str, Any]:
    """``cache=`` on transformers >= 5.2x, ``past_key_values=`` before (e.g. 5.17 on the GPU
    image)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits[0, -1]).item())


@torch.no_grad()
def plain_generate(lm: LiveModel, prompt: LivePrompt, max_new_tokens: int) -> list[int]:
    """Stock ``generate`` (greedy, full cache, no session): the reference output."""
    token = ACTIVE.set(None)
    try:
        out = lm.model.generate(**prompt.prefill_inputs(), max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1)
    finally:
        ACTIVE.reset(token)
    seq = out[0].tolist()
    if "input_ids" in prompt.prefill_inputs():
        seq = seq[prompt.n_prompt:]
    return seq


def _prefill_forward(lm: LiveModel, prompt: LivePrompt, cache: Any) -> tuple[Any, float]:
    """The prefill forward of ``prompt`` into ``cache``; returns the output and the audio KV
    retention left by an in-layer AffPool (``prompt.layer_pool``, WnW App. F; 1.0 without)."""
    if prompt.layer_pool is None:
        out = lm.model(**prompt.prefill_inputs(), **_cache_kw(lm.model, cache), use_cache=True,
                       logits_to_keep=1)
        return out, 1.0
    from kvsim.tracer.transforms.affpool_layers import LayerAffPool, decoder_layers, pooling_hooks

    n_layers = lm.layout.n_layers
    pool = LayerAffPool(prompt.layer_pool, n_layers, prompt.audio_positions)
    with pooling_hooks(decoder_layers(lm.model, n_layers, LIVE_ATTN), pool):
        out = lm.model(**prompt.prefill_inputs(), **_cache_kw(lm.model, cache), use_cache=True,
                       logits_to_keep=1)
    pool.shrink_cache(cache)
    return out, pool.retention


@dataclass
class Prefilled:
    """The full-attention prefill of one prompt, shared by every policy run on it (the prefill
    is policy-independent: compression applies to decoding)."""

    cache: Any
    first_logits: torch.Tensor  #: (1, 1, V) the logits the first answer token is chosen from
    queries: list[np.ndarray]
    keys: list[np.ndarray]
    seconds: float
    kv_retention: float = 1.0  #: audio KV left by an in-layer AffPool (1.0 without)


@torch.no_grad()
def prefill_once(lm: LiveModel, prompt: LivePrompt, window: int = OBSERVATION_WINDOW) -> Prefilled:
    """Run the prefill once, capturing the observation-window queries (the last ``window``
    prompt positions) and the prompt keys."""
    from transformers import DynamicCache

    from kvsim.policies import registry

    ctx = PolicyContext(heads=lm.layout, n_audio=prompt.n_audio, audio_tokens_per_s=lm.audio_tokens_per_s,
                        n_prefill=prompt.n_prompt)
    session = LiveSession(registry.make("full", 1.0), ctx, prompt.audio_positions, prompt.n_prompt,
                          window=window)
    cache = DynamicCache(config=lm.model.config)
    token = ACTIVE.set(session)
    try:
        t0 = time.perf_counter()
        out, kv_retention = _prefill_forward(lm, prompt, cache)
        _sync(lm.device)
        secs = time.perf_counter() - t0
    finally:
        ACTIVE.reset(token)
    return Prefilled(cache, out.logits[:, -1:].clone(), list(session._pq), list(session._pk),
                     secs, kv_retention)


def _read_window(lm: LiveModel, prompt: LivePrompt, cfg: LiveConfig) -> ReadWindow | None:
    """The read window of ``cfg`` over ``prompt``'s audio (None without one); ValueError
    when the model or the prompt cannot take it."""
    if cfg.read_window is None:
        return None
    cfg.read_window.check_layers(lm.layout.n_layers, lm.name)
    if cfg.read_window.limits_others:
        raise ValueError("read window: limiting the other layers' reach (others_s) is a "
                         "diagnostic of python -m kvsim.minivox.evaluate, not of live decoding")
    audio = prompt.audio_positions
    if prompt.layer_pool is not None or int(audio[-1] - audio[0]) + 1 != len(audio):
        raise ValueError(f"read window: the audio of the prompt must be one contiguous span "
                         f"with one audio KV per layer (transform {prompt.transform})")
    return ReadWindow(cfg.read_window, int(audio[0]), len(audio), lm.audio_tokens_per_s)


def _open_session(lm: LiveModel, prompt: LivePrompt, spec: PolicySpec, cfg: LiveConfig,
                  prefilled: Prefilled | None) -> tuple[PolicyContext, LiveSession]:
    """The policy of ``spec`` in a :class:`LiveSession` for ``prompt`` (with ``cfg``'s read
    window, if any); a shared prefill must hold the observation window this run wants."""
    ctx = PolicyContext(heads=lm.layout, n_audio=prompt.n_audio,
                        audio_tokens_per_s=lm.audio_tokens_per_s, n_prefill=prompt.n_prompt,
                        head_scores=cfg.head_scores, seed=cfg.seed)
    session = LiveSession(spec.make(), ctx, prompt.audio_positions, prompt.n_prompt,
                          label=f"{spec.label}@{spec.budget:g}", physical=cfg.physical,
                          check_invariants=cfg.check_invariants, window=cfg.observation_window,
                          device_select=(lm.device.type != "cpu" if cfg.device_select is None
                                         else cfg.device_select),
                          read_window=_read_window(lm, prompt, cfg))
    q0 = prefilled.queries[0] if prefilled is not None else None
    if q0 is not None and q0.shape[1] != len(session.window):
        raise ValueError(f"the shared prefill holds {q0.shape[1]} window queries, "
                         f"the run wants {len(session.window)} (observation_window differs)")
    session.dtype_bytes = lm.dtype_bytes
    return ctx, session


def _physical_summary(stats: Any, cache: Any, n_steps: int) -> dict[str, float]:
    """Per-step copies and bytes of the physical offload path, and the audio KV on device."""
    steps = max(n_steps, 1)
    return dict(
        physical_h2d_mb_per_step=stats.h2d_bytes / 1e6 / steps,
        physical_copies_per_step=stats.copies / steps,
        physical_rebuilds_per_step=stats.rebuilds / steps,
        device_audio_mb=sum(layer.device_audio_bytes() for layer in cache.layers) / 1e6,
    )


@torch.no_grad()
def live_generate(lm: LiveModel, prompt: LivePrompt, spec: PolicySpec, cfg: LiveConfig,
                  prefilled: Prefilled | None = None) -> LiveRun:
    """Greedy decoding of ``prompt`` with ``spec``'s policy managing the audio KV.

    Prefill runs with full attention (compression applies to decoding, as in WnW §3.3); the
    policy then sets tiers from the observation-window attention and updates them after every
    step; attention of every decode step reads only what the policy keeps (and selects).
    ``prefilled`` (from :func:`prefill_once` on the same prompt) skips recomputing the prefill.
    """
    import copy

    from transformers import DynamicCache

    if lm.text_config._attn_implementation != LIVE_ATTN:
        raise ValueError(f"{lm.name}: the text decoder does not use the {LIVE_ATTN!r} attention")
    if prompt.layer_pool is not None and (spec.name != "full" or cfg.physical):
        raise ValueError(f"{spec.label}: in-layer AffPool ({prompt.transform}) gives every layer "
                         "its own audio KV length; it runs with policy full, masking path only")
    model, device = lm.model, lm.device
    ctx, session = _open_session(lm, prompt, spec, cfg, prefilled)
    eos = lm.eos_ids
    cache = DynamicCache(config=model.config) if prefilled is None else copy.deepcopy(prefilled.cache)
    token = ACTIVE.set(session)
    stats = None
    peak = None
    mem: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        t0 = time.perf_counter()
        if prefilled is None:
            out, kv_retention = _prefill_forward(lm, prompt, cache)
            first_logits = out.logits[:, -1:]
        else:
            session._pq, session._pk = list(prefilled.queries), list(prefilled.keys)
            first_logits, kv_retention = prefilled.first_logits, prefilled.kv_retention
        tiers0 = session.finish_prefill()
        history = [tiers0.copy()] if cfg.record_tiers else None
        attention: list[np.ndarray] = []
        if cfg.physical:
            session.cache = cache
            stats = install_offload(cache, prompt.audio_positions, tiers0 == 2, device)
        _sync(device)
        prefill_s = time.perf_counter() - t0 + (prefilled.seconds if prefilled is not None else 0.0)
        if device.type == "cuda":
            # decode-time memory: after prefill, once the offloaded audio KV has left the device
            mem["prefill_peak_mb"] = torch.cuda.max_memory_allocated(device) / 1e6
            mem["after_prefill_mb"] = torch.cuda.memory_allocated(device) / 1e6
            torch.cuda.reset_peak_memory_stats(device)
        option_processors = _processors(lm, prompt, cfg, session.read_window)
        processors = option_processors.as_list()
        first = _next_token(first_logits, [], processors)
        tokens, step_ms, terminated = _decode_loop(lm, session, cache, first, prompt.n_prompt,
                                                   cfg.max_new_tokens, history, attention,
                                                   processors)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
    finally:
        ACTIVE.reset(token)
    summary = _run_summary(session, ctx, spec, prompt, prefill_s, step_ms, terminated,
                           len(tokens), kv_retention)
    summary.update(_decoding_option_summary(cfg, session.read_window, option_processors))
    if stats is not None:
        summary.update(_physical_summary(stats, cache, len(step_ms)))
    if peak is not None:
        summary["peak_mem_mb"] = peak / 1e6  # during decoding
        summary.update(mem)
    return LiveRun(spec=spec, tokens=tokens, text=lm.decode([t for t in tokens if t not in eos]),
                   terminated=terminated, summary=summary, step_log=_step_log(session),
                   facts=_run_facts(lm, ctx, prompt, spec, len(session.rows)),
                   tiers_after_prefill=tiers0, tiers=history,
                   step_attention=attention if cfg.record_tiers else None,
                   extra=({"read_windows": session.read_window.windows}
                          if session.read_window is not None else {}))


def _processors(lm: LiveModel, prompt: LivePrompt, cfg: LiveConfig,
                window: ReadWindow | None) -> OptionProcessors:
    """The logits processors of ``cfg``'s decoding options (the generated tokens only: the
    prompt length the ban sees is 0); ValueError when the hold is on and the prompt does not
    mark its encoder padding."""

    def n_speech() -> int:
        if prompt.audio_padding is None:
            raise ValueError(f"--hold-end: {lm.name} does not mark the encoder padding of its "
                             "prompt, so the end of the speech is unknown")
        return speech_tokens_of(prompt.audio_padding)

    return OptionProcessors.build(cfg.ban_cycles, 0, cfg.hold_end, window, n_speech,
                                  sorted(lm.eos_ids), lm.audio_tokens_per_s)


def _decoding_option_summary(cfg: LiveConfig, window: ReadWindow | None,
                             processors: OptionProcessors) -> dict[str, Any]:
    """The decoding options of the run and what they did (None / 0 when off)."""
    ban, hold = processors.ban, processors.hold
    return {
        "read_window": cfg.read_window.spec() if cfg.read_window else None,
        "read_forced": window.reading.forced if window else 0,
        "read_stopped": window.reading.past_end if window else False,
        "ban_cycles": cfg.ban_cycles.spec() if cfg.ban_cycles else None,
        "cycle_bans": ban.fired if ban else 0,
        "hold_end": cfg.hold_end,
        "end_holds": hold.held if hold else 0,
    }


def _next_token(logits: torch.Tensor, tokens: list[int],
                processors: list[CycleBan | HoldEnd]) -> int:
    """Greedy choice from the step's ``logits`` (1, 1, V), over what ``processors`` (the
    decoding options' logits processors) leave after ``tokens``, the tokens generated so far."""
    if not processors:
        return _argmax(logits)
    scores = logits[:, -1].clone()
    ids = torch.tensor([tokens], dtype=torch.long)
    for processor in processors:
        scores = processor(ids, scores)
    return int(torch.argmax(scores[0]).item())


def _decode_loop(lm: LiveModel, session: LiveSession, cache: Any, first: int, n_prompt: int,
                 max_new_tokens: int, history: list[np.ndarray] | None,
                 attention: list[np.ndarray],
                 processors: list[CycleBan | HoldEnd]) -> tuple[list[int], list[float], bool]:
    """Greedy decode steps after the first token until EOS, ``max_new_tokens`` or the end of
    the read window's audio; returns the tokens, each step's milliseconds and whether the run
    ended before the cap (EOS, or a read window with nothing left to read). ``history`` (when
    recording) receives the tiers after every step and ``attention`` the step's audio
    attention; ``processors`` (the decoding options') narrow each greedy choice."""
    model, device, eos = lm.model, lm.device, lm.eos_ids
    window = session.read_window
    tokens, step_ms = [first], []
    terminated = first in eos
    step = 0
    while not terminated and len(tokens) < max_new_tokens:
        session.begin_step(step)
        t1 = time.perf_counter()
        ids = torch.tensor([[tokens[-1]]], dtype=torch.long, device=device)
        pos = torch.tensor([n_prompt + step], dtype=torch.long, device=device)
        # position ids are left to the model (Qwen's M-RoPE offsets come from its prefill)
        out = model(input_ids=ids, **_cache_kw(model, cache), use_cache=True, cache_position=pos,
                    logits_to_keep=1)
        tokens.append(_next_token(out.logits, tokens, processors))
        _sync(device)
        step_ms.append(1e3 * (time.perf_counter() - t1))
        if history is not None and session.buffer is not None:
            attention.append(session.buffer.copy())
        session.end_step(step, n_prompt + step)
        if history is not None:
            history.append(session.tiers.copy())
        terminated = tokens[-1] in eos or (window is not None and window.reading.past_end)
        step += 1
    return tokens, step_ms, terminated


def _step_log(session: LiveSession) -> pl.DataFrame:
    return (pl.DataFrame(session.rows, schema=STEP_LOG_COLUMNS) if session.rows
            else pl.DataFrame(schema=STEP_LOG_COLUMNS))


def _run_summary(session: LiveSession, ctx: PolicyContext, spec: PolicySpec, prompt: LivePrompt,
                 prefill_s: float, step_ms: list[float], terminated: bool, n_tokens: int,
                 kv_retention: float) -> dict[str, Any]:
    """The run's summary; an in-layer AffPool run reports its remaining audio ratio (WnW §3.3)."""
    summary = _summary(session, _step_log(session), ctx, spec, prompt, prefill_s, step_ms,
                       terminated, n_tokens)
    if prompt.layer_pool is not None:
        summary["input_retention"] = kv_retention
        summary["r_gpu_vs_original"] = summary["r_gpu"] * kv_retention
    return summary


def _run_facts(lm: LiveModel, ctx: PolicyContext, prompt: LivePrompt, spec: PolicySpec,
               n_decode: int) -> RunFacts:
    return RunFacts(
        model=lm.name, n_layers=ctx.heads.n_layers, n_q_heads=ctx.heads.n_q_heads,
        n_kv_heads=ctx.heads.n_kv_heads, head_dim=ctx.heads.head_dim, dtype_bytes=lm.dtype_bytes,
        n_audio=ctx.n_audio, n_prefill=prompt.n_prompt, n_decode=n_decode,
        policy=spec.label, budget=spec.budget, audio_tokens_per_s=lm.audio_tokens_per_s,
    )


def _summary(session: LiveSession, log: pl.DataFrame, ctx: PolicyContext, spec: PolicySpec,
             prompt: LivePrompt, prefill_s: float, step_ms: list[float], terminated: bool,
             n_tokens: int) -> dict[str, Any]:
    gpu, cpu, read = retention_per_step(log, ctx.audio_kv_total, session.prefill_r_gpu)
    retention = prompt.n_audio / max(prompt.original_n_audio, 1)
    return {
        "policy": spec.name,
        "label": spec.label,
        "budget": spec.budget,
        "transform": prompt.transform,
        "path": "physical" if session.physical else "mask",
        "n_audio": ctx.n_audio,
        "n_audio_original": prompt.original_n_audio,
        "input_retention": retention,
        "tokens": n_tokens,
        "steps": log.height,
        "terminated": terminated,
        "r_gpu": float(gpu.mean()),
        "r_gpu_max": float(gpu.max()),
        "r_gpu_prefill": session.prefill_r_gpu,
        "r_gpu_cpu": float((gpu + cpu).mean()),
        # against the untransformed audio span (input transforms shrink T_a first)
        "r_gpu_vs_original": float(gpu.mean()) * retention,
        "read_fraction": float(read.mean()),
        "h2d_mb_per_step": float(log["h2d_bytes"].mean() / 1e6) if log.height else 0.0,
        "transfers_per_step": float(log["h2d_transfers"].mean()) if log.height else 0.0,
        "ms_per_token": float(np.mean(step_ms)) if step_ms else float("nan"),
        "ms_per_token_median": float(np.median(step_ms)) if step_ms else float("nan"),
        "prefill_s": prefill_s,
        "policy_seconds": session.policy_seconds,
    }
