"""Synthetic traces: real queries and keys whose softmax has the structure WnW §2.1 measured.

Nothing here stores probabilities. Every key and query is a vector; attention is whatever
``softmax(q·Kᵀ/√d)`` gives. The vectors are built from interpretable features, then rotated by
a random orthogonal matrix per (layer, KV-head) so that no feature sits on one channel:

* audio keys carry a **time code** ``c(τ)`` (sines/cosines of geometric frequencies, so
  ``c(τ)·c(τ')`` peaks at ``τ = τ'``), a **sink** feature decaying over the first audio tokens,
  a **start tilt** ``1 - τ/T_a``, a per-position **salience** shared by all heads (content that
  any query may like), and noise;
* decode queries of **frontier** heads point at ``c(f_j)`` where the frontier ``f_j`` sweeps
  through the audio as tokens are generated (speech is time-ordered, WnW §2.1); **diffuse**
  heads have weak, random queries; **sink** heads keep attending to the audio start;
* the prompt's observation-window queries (the last 32 prompt positions, audio included; prefill)
  lean on sink + tilt, which reproduces the
  prefill attention sink.

Ground-truth head scores are stored with the trace: the voice score is the expected hit ratio
of the head's top-K on the current word (high for frontier heads), the sensitivity a
log-normal draw correlated with it; so calibrated policies (WnW, AudioKV) run without a model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from kvsim.core.shapes import HeadScores
from kvsim.shapes import get_shape
from kvsim.trace.schema import OBSERVATION_WINDOW, ModelFacts, TraceMeta, observation_window
from kvsim.trace.writer import TraceData, default_provenance, positions_frame

ROLES = ("frontier", "diffuse", "sink")


@dataclass(frozen=True)
class SynthConfig:
    """What to synthesise. Defaults give a trace with WnW §2.1-like statistics."""

    preset: str = "minivox"
    audio_seconds: float = 60.0
    decode_steps: int = 120
    seed: int = 0
    n_system: int = 6  #: system/text positions before the audio (position 0 is the BOS sink)
    n_text_after: int = 12  #: prompt text after the audio
    #: stored prompt queries: the last 32 prompt positions (audio included), as the tracer
    observation_window: int = OBSERVATION_WINDOW
    store_values: bool = True
    # feature strengths, in logit units (tuned so the default trace lands near WnW §2.1)
    role_mix: tuple[float, float, float] = (0.55, 0.3, 0.15)  #: frontier, diffuse, sink
    frontier_sharpness: tuple[float, float] = (7.0, 13.0)  #: uniform range
    prefill_sink: tuple[float, float] = (5.0, 8.5)
    prefill_tilt: tuple[float, float] = (0.0, 0.5)
    salience: float = 0.15
    noise: float = 0.6
    bos_strength: float = 4.0
    sink_head_decode: tuple[float, float] = (2.0, 5.0)  #: sink strength of sink heads at decode
    tokens_per_word: float = 1.35


def _time_code(n: int, n_freq: int, min_period: float) -> np.ndarray:
    """(n, 2F) sin/cos features with geometric frequencies; rows have unit norm."""
    periods = np.geomspace(max(2.0 * n, 8.0), min_period, n_freq)
    omega = 2 * np.pi / periods
    ang = np.arange(n)[:, None] * omega[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1) / math.sqrt(n_freq)


def _frontier(rng: np.random.Generator, n_audio: int, n_decode: int, tpw: float) -> np.ndarray:
    """Audio index each decode step looks at: word-by-word through the audio, with jitter."""
    n_words = max(1, round(n_decode / tpw))
    word_of_step = np.minimum((np.arange(n_decode) / tpw).astype(int), n_words - 1)
    # words have random durations (speaking-rate variation) and cover the audio
    durations = rng.gamma(4.0, 1.0, n_words)
    edges = np.concatenate([[0.0], np.cumsum(durations)]) / durations.sum() * n_audio
    centre = 0.5 * (edges[:-1] + edges[1:])
    return np.clip(centre[word_of_step], 0, n_audio - 1), edges, word_of_step


def synthesize(cfg: SynthConfig) -> TraceData:
    """Build a synthetic trace (see module docstring) with the shape of ``cfg.preset``."""
    shape = get_shape(cfg.preset)
    if cfg.audio_seconds <= 0 or cfg.decode_steps < 1:
        raise ValueError("audio_seconds must be > 0 and decode_steps >= 1")
    rng = np.random.default_rng(cfg.seed)
    L, Hq, Hkv, D = shape.n_layers, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    g = Hq // Hkv
    n_audio = max(8, round(cfg.audio_seconds * shape.audio_tokens_per_s))
    a0 = cfg.n_system
    n_prefill = cfg.n_system + n_audio + cfg.n_text_after
    n_decode = cfg.decode_steps
    N = n_prefill + n_decode
    audio = slice(a0, a0 + n_audio)

    # ---------------------------------------------------------------- feature layout
    n_freq = max(2, D // 4)
    i_time = slice(0, 2 * n_freq)
    i_sink, i_tilt, i_sal, i_bos = 2 * n_freq, 2 * n_freq + 1, 2 * n_freq + 2, 2 * n_freq + 3
    i_noise = slice(2 * n_freq + 4, D)
    n_noise = D - (2 * n_freq + 4)
    if n_noise < 2:
        raise ValueError(f"head_dim {D} too small for synthetic features")
    word_tokens = max(2.0, shape.audio_tokens_per_s * 0.35)  # ~one word
    code = _time_code(n_audio, n_freq, min_period=4 * word_tokens)
    salience = np.clip(rng.normal(0, 1, n_audio), 0, None)  # content, shared by heads
    frontier, word_edges, word_of_step = _frontier(rng, n_audio, n_decode, cfg.tokens_per_word)

    # query positions: observation window + every decode step
    window = np.asarray(observation_window(n_prefill, cfg.observation_window), dtype=np.int64)
    qpos = np.concatenate([window, np.arange(n_prefill, N)])
    W = len(window)
    # window rows at or before the audio's end draw their noise from a stream of their own, so
    # the rest of the trace is the one a window of the text after the audio gave
    n_early = int((window < a0 + n_audio).sum())
    early_rng = np.random.default_rng([cfg.seed, 1])

    keys = np.empty((L, Hkv, N, D), dtype=np.float32)
    queries = np.empty((L, Hq, len(qpos), D), dtype=np.float32)
    values = np.empty((L, Hkv, N, D), dtype=np.float32) if cfg.store_values else None
    roles = np.empty((L, Hq), dtype=np.int64)
    sharp = np.zeros((L, Hq))
    sqrt_d = math.sqrt(D)

    tau = np.arange(n_audio)
    for layer in range(L):
        for kv in range(Hkv):
            feat = np.zeros((N, D))
            feat[audio, i_time] = code
            feat[audio, i_sink] = np.exp(-tau / 1.5)
            feat[audio, i_tilt] = 1.0 - tau / n_audio
            feat[audio, i_sal] = salience * rng.uniform(0.7, 1.3)
            feat[0, i_bos] = 1.0
            feat[:, i_noise] = rng.normal(0, 1, (N, n_noise)) / math.sqrt(n_noise)
            # text / generated keys: weak time code near the frontier region is not needed
            rot, _ = np.linalg.qr(rng.normal(size=(D, D)))
            keys[layer, kv] = feat @ rot
            if values is not None:
                values[layer, kv] = rng.normal(0, 1, (N, D))
            group_role = rng.choice(3, p=cfg.role_mix)
            for j in range(g):
                h = kv * g + j
                role = group_role if rng.random() < 0.75 else rng.choice(3, p=cfg.role_mix)
                roles[layer, h] = role
                qf = np.zeros((len(qpos), D))
                # prefill window: sink + tilt + salience (+ BOS)
                qf[:W, i_sink] = rng.uniform(*cfg.prefill_sink)
                qf[:W, i_tilt] = rng.uniform(*cfg.prefill_tilt)
                qf[:, i_sal] = cfg.salience * rng.exponential(1.0)
                qf[:, i_bos] = cfg.bos_strength * rng.uniform(0.5, 1.0)
                # decode queries by role
                if role == 0:  # frontier tracker (lag of up to a word)
                    s = rng.uniform(*cfg.frontier_sharpness)
                    sharp[layer, h] = s
                    lag = rng.uniform(0, word_tokens)
                    look = np.clip(frontier - lag + rng.normal(0, 0.3 * word_tokens, n_decode), 0, n_audio - 1)
                    qf[W:, i_time] = s * code[np.round(look).astype(int)]
                    qf[W:, i_sink] = rng.uniform(0, 0.5)
                elif role == 1:  # diffuse
                    qf[W:, i_time] = rng.uniform(0.5, 2.0) * code[rng.integers(0, n_audio, n_decode)]
                    qf[W:, i_sal] *= 0.5
                else:  # sink head
                    qf[W:, i_sink] = rng.uniform(*cfg.sink_head_decode)
                    qf[W:, i_tilt] = rng.uniform(0.0, 1.0)
                qf[n_early:, i_noise] = rng.normal(0, cfg.noise, (len(qpos) - n_early, n_noise))
                qf[:n_early, i_noise] = early_rng.normal(0, cfg.noise, (n_early, n_noise))
                # logits = qf·feat_k (before rotation); store q so that q·k/√D equals that
                queries[layer, h] = (qf @ rot) * sqrt_d

    # ground-truth head scores per KV-head
    vs_q = np.where(roles == 0, 0.35 + 0.6 * (sharp - 7.0) / 6.0, np.where(roles == 1, 0.05, 0.02))
    vs = vs_q.reshape(L, Hkv, g).mean(-1)
    hs = np.exp(rng.normal(0, 0.5, (L, Hkv))) * (0.3 + vs)
    scores = HeadScores(vs, hs, source="synthetic ground truth")

    # positions table
    kinds = ["text"] * N
    kinds[:a0] = ["system"] * a0
    kinds[audio] = ["audio"] * n_audio
    kinds[n_prefill:] = ["generated"] * n_decode
    tok_s = 1.0 / shape.audio_tokens_per_s
    start = np.full(N, np.nan)
    end = np.full(N, np.nan)
    start[audio] = tau * tok_s
    end[audio] = (tau + 1) * tok_s
    wstart = np.full(N, np.nan)
    wend = np.full(N, np.nan)
    words: list[str | None] = [None] * N
    for j in range(n_decode):
        w = word_of_step[j]
        wstart[n_prefill + j] = word_edges[w] * tok_s
        wend[n_prefill + j] = word_edges[w + 1] * tok_s
        words[n_prefill + j] = f"w{w}"
    token_ids = rng.integers(10, 30000, N)
    positions = positions_frame(kinds, token_ids, qpos, start, end, words, wstart, wend)

    meta = TraceMeta(
        model=ModelFacts(name=shape.name, n_layers=L, n_q_heads=Hq, n_kv_heads=Hkv,
                         head_dim=D, audio_tokens_per_s=shape.audio_tokens_per_s),
        n_positions=N,
        n_prefill=n_prefill,
        n_decode=n_decode,
        prompt="<synthetic>",
        generated_text=" ".join(f"w{w}" for w in np.unique(word_of_step)),
        audio={"duration_s": n_audio * tok_s, "source": "synthetic"},
        provenance={**default_provenance(), "generator": "kvsim.synth", "config": _jsonable(cfg),
                    "roles": {r: int((roles == i).sum()) for i, r in enumerate(ROLES)}},
    )
    return TraceData(meta=meta, keys=keys, queries=queries, query_positions=qpos,
                     positions=positions, values=values, head_scores=scores)


def _jsonable(cfg: SynthConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
