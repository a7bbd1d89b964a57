"""Analytic per-step workloads of a policy on long-form audio (no trace needed).

:func:`analytic_workload` turns a policy description into a :class:`StepWorkload`:

- ``full``: every audio position on GPU, no transfers.
- ``snapkv`` (any static prefill-only policy): ``floor(r * T_a)`` positions per (layer,
  KV-head) on GPU, no transfers.
- ``wnw`` (WnW paper §2.3): ``n_anchor`` anchor heads keep all audio on GPU; the other heads
  keep the per-segment top ``round(retention * n_s)`` positions (the paper tunes lambda so
  the measured r_GPU meets the target, so the resident total is ``r_gpu * L * H_kv * T_a``); tidal heads additionally hold
  the full content of the segments covered by the top-k chunks (chunks of two segments, stride
  one segment) and recall the missing ``n_s - round(retention * n_s)`` positions of each
  segment entering that window; segments leaving it are released after ``delta`` steps.

The chunk window follows the decode frontier, which advances one ``segment_s``-second segment
every ``segment_s * words_per_s * tokens_per_word`` generated tokens (speech ~2.5 words/s,
~1.3 tokens/word: one 2-s segment per 6.5 tokens). ``churn_segments_per_step`` (default 0) adds
re-fetches of released segments (anchor scores jumping between chunks), each resident for
``delta`` steps: a sensitivity knob, not a fitted constant. Missing positions of a segment form
``m (k + 1) / n_s`` contiguous runs on average when the kept top-k positions are scattered
independently (expected number of runs of a random k-subset's complement).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvsim.core.steplog import RunFacts
from kvsim.sim.presets import ModelPreset
from kvsim.sim.workload import StepWorkload

#: Longest audio (minutes) and most decode steps of an analytic workload: the simulation's
#: time and memory grow with its steps (240 min of audio, 46,800 steps: about 15 s per GPU and
#: mode on one core); both are far beyond the context of the models simulated.
MAX_AUDIO_MINUTES = 240
MAX_DECODE_STEPS = 100_000


class AnalyticError(ValueError):
    """An invalid analytic policy description (one-line message)."""


@dataclass(frozen=True)
class AnalyticPolicy:
    """A policy's per-step behaviour, described by its parameters rather than a replay.

    ``r_gpu`` is the target fraction of audio KV on GPU over all (layer, KV-head) pairs
    (WnW §3.4); for WnW the non-anchor heads' retention is solved from it.
    """

    policy: str = "full"
    r_gpu: float = 1.0
    tidal_heads: int = 0
    anchor_heads: int = 5
    segment_s: float = 2.0
    top_k_chunks: int = 3
    release_lag: int = 3
    words_per_s: float = 2.5
    tokens_per_word: float = 1.3
    prompt_tokens: int = 32
    churn_segments_per_step: float = 0.0  # extra (re)entries of released segments per step

    def check(self, model: ModelPreset) -> None:
        heads = model.n_layers * model.n_kv_heads
        p = self.policy.lower()
        if p not in ("full", "snapkv", "static", "wnw"):
            raise AnalyticError(f"analytic policy {self.policy!r}: use full, snapkv, static or wnw")
        if not self.churn_segments_per_step >= 0:  # NaN too
            raise AnalyticError(f"churn must be >= 0, got {self.churn_segments_per_step}")
        if not 0 < self.r_gpu <= 1:
            raise AnalyticError(f"r_gpu must be in (0, 1], got {self.r_gpu}")
        if p == "wnw":
            if self.anchor_heads < 0 or self.tidal_heads < 0:
                raise AnalyticError("anchor_heads and tidal_heads must be >= 0")
            if self.anchor_heads + self.tidal_heads > heads:
                raise AnalyticError(
                    f"{self.anchor_heads} anchor + {self.tidal_heads} tidal heads > "
                    f"{heads} KV-heads of {model.name}"
                )
            if self.r_gpu * heads < self.anchor_heads:
                raise AnalyticError(f"r_gpu={self.r_gpu} is below the anchors' own share")

    def tidal_retention(self, model: ModelPreset) -> float:
        """Retention of non-anchor heads so that the total matches ``r_gpu``."""
        heads = model.n_layers * model.n_kv_heads
        if self.policy.lower() != "wnw":
            return self.r_gpu
        return (self.r_gpu * heads - self.anchor_heads) / (heads - self.anchor_heads)


def decode_steps_for(audio_s: float, pol: AnalyticPolicy) -> int:
    """Generated tokens of a verbatim transcript of ``audio_s`` seconds of speech."""
    return max(1, round(audio_s * pol.words_per_s * pol.tokens_per_word))


def analytic_workload(
    model: ModelPreset, pol: AnalyticPolicy, audio_s: float, n_decode: int | None = None
) -> StepWorkload:
    """Per-step workload of ``pol`` on ``audio_s`` seconds of audio (see module docstring)."""
    pol.check(model)
    if not 0 < audio_s <= MAX_AUDIO_MINUTES * 60:
        raise AnalyticError(f"audio length must be in (0, {MAX_AUDIO_MINUTES * 60}] s, got {audio_s:g}")
    L, H = model.n_layers, model.n_kv_heads
    T_a = max(1, round(audio_s * model.audio_tokens_per_s))
    S = n_decode or decode_steps_for(audio_s, pol)
    if not 1 <= S <= MAX_DECODE_STEPS:
        raise AnalyticError(f"decode steps must be in [1, {MAX_DECODE_STEPS}], got {S}")
    p = pol.policy.lower()
    facts = RunFacts(
        model=model.name, n_layers=L, n_q_heads=model.n_q_heads, n_kv_heads=H,
        head_dim=model.head_dim, dtype_bytes=model.dtype_bytes, n_audio=T_a,
        n_prefill=T_a + pol.prompt_tokens, n_decode=S, policy=p, budget=pol.r_gpu,
        audio_tokens_per_s=model.audio_tokens_per_s,
    )
    steps = np.arange(S, dtype=np.int64)
    non_audio = pol.prompt_tokens + steps
    tok = np.zeros((S, L), dtype=np.int64)
    runs = np.zeros((S, L), dtype=np.int64)
    segs = np.zeros((S, L), dtype=np.int64)
    cpu = np.zeros(S, dtype=np.int64)
    if p == "full":
        gpu = np.full(S, L * H * T_a, dtype=np.int64)
    elif p in ("snapkv", "static"):
        gpu = np.full(S, L * H * math.floor(pol.r_gpu * T_a), dtype=np.int64)
    else:
        gpu = _wnw_steps(model, pol, T_a, tok, runs, segs, cpu)
    return StepWorkload(
        facts=facts, non_audio_tokens=non_audio, gpu_audio_tokens=gpu,
        read_audio_tokens=gpu.copy(), h2d_tokens_by_layer=tok, h2d_runs_by_layer=runs,
        h2d_segments_by_layer=segs, cpu_audio_tokens=cpu, segments_exact=True,
    )


def _wnw_steps(model: ModelPreset, pol: AnalyticPolicy, T_a: int, tok: np.ndarray,
               runs: np.ndarray, segs: np.ndarray, cpu: np.ndarray) -> np.ndarray:
    """GPU-resident audio tokens of WnW at every step; fills the recalls per (step, layer)
    (``tok``, ``runs``, ``segs``) and the CPU-only tokens (``cpu``) in place."""
    L, H = model.n_layers, model.n_kv_heads
    n_s = max(1, math.ceil(pol.segment_s * model.audio_tokens_per_s))
    n_seg = math.ceil(T_a / n_s)
    if pol.churn_segments_per_step > n_seg:
        raise AnalyticError(f"churn (--churn) must be <= {n_seg}, the audio's {pol.segment_s:g}-s "
                            f"segments (re-fetched per step), got {pol.churn_segments_per_step:g}")
    r_t = pol.tidal_retention(model)
    k = round(r_t * n_s)  # per-segment top-k (WnW §2.3); lambda is tuned to hit r_gpu
    m = n_s - k
    runs_per_seg = m * (k + 1) / n_s if m else 0.0
    base = round(pol.r_gpu * L * H * T_a)
    tidal_l = np.full(L, pol.tidal_heads // L, dtype=np.int64)
    tidal_l[: pol.tidal_heads % L] += 1
    tokens_per_seg = pol.segment_s * pol.words_per_s * pol.tokens_per_word
    churn = _Churn(pol.churn_segments_per_step, pol.release_lag)
    full: dict[int, int] = {}  # segment -> steps it has been unselected
    gpu = np.zeros(len(cpu), dtype=np.int64)
    width = pol.top_k_chunks + 1  # top-k overlapping 2-segment chunks, stride 1 segment
    for s in range(len(cpu)):
        f = min(int(s / tokens_per_seg), n_seg - 1)
        lo = max(0, min(f - 1, n_seg - width))
        new = _advance_window(full, set(range(lo, min(n_seg, lo + width))), pol.release_lag)
        n_in = len(new) + churn.step(s)
        if n_in and m:
            tok[s] = tidal_l * m * n_in
            runs[s] = np.round(tidal_l * runs_per_seg * n_in).astype(np.int64)
            segs[s] = tidal_l * n_in
        resident = len(full) + churn.n_live
        gpu[s] = base + pol.tidal_heads * m * resident
        cpu[s] = pol.tidal_heads * m * max(n_seg - resident, 0)  # CPU-only complement
    return gpu


def _advance_window(full: dict[int, int], window: set[int], release_lag: int) -> list[int]:
    """Move the chunk window: segments in ``window`` are (or stay) fully resident, the others
    are released after ``release_lag`` steps out of it. Returns the segments entering it."""
    new = [g for g in window if g not in full]
    for g in list(full):
        if g in window:
            full[g] = 0
        else:
            full[g] += 1
            if full[g] >= release_lag:
                del full[g]
    for g in new:
        full[g] = 0
    return new


class _Churn:
    """Re-fetches of released segments, ``per_step`` on average, each resident ``lag`` steps.

    ``live`` holds one ``(step, count)`` pair per step of the last ``lag`` steps, so memory
    and time do not grow with ``per_step``."""

    def __init__(self, per_step: float, lag: int) -> None:
        self.per_step, self.lag = per_step, lag
        self.acc = 0.0
        self.live: deque[tuple[int, int]] = deque()  # (step re-fetched at, segments)
        self.n_live = 0  # churned segments resident now

    def step(self, s: int) -> int:
        """Segments re-fetched at step ``s``."""
        self.acc += self.per_step
        n = int(self.acc)
        self.acc -= n
        while self.live and s - self.live[0][0] >= self.lag:
            self.n_live -= self.live.popleft()[1]
        if n:
            self.live.append((s, n))
            self.n_live += n
        return n
