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
from pathlib import Path

import numpy as np
import polars as pl

from kvsim.core.shapes import HeadScores
from kvsim.shapes import get_shape
from kvsim.trace.schema import OBSERVATION_WINDOW, ModelFacts, TraceMeta, observation_window
from kvsim.trace.writer import TraceData, TraceWriter, default_provenance, positions_frame

ROLES = ("frontier", "diffuse", "sink")
#: longest synthetic audio (s): four hours, twice the longest trace measured in
#: docs/performance.md; at it a voxtral-mini trace with values is ~22 GB on disk and a layer
#: ~2.5 GB of memory while drawn (beyond it memory, not the model, is the limit)
MAX_AUDIO_SECONDS = 4 * 3600.0
#: most synthetic decode steps: 65,536, more tokens than four hours of speech transcribe to
MAX_DECODE_STEPS = 65536


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


class _Synthesizer:
    """The draws of one synthetic trace, layer by layer (see the module docstring).

    The layout (time code, salience, word frontier, query positions) is drawn on construction;
    :meth:`layer` then draws one layer's keys, queries and values, and must be called for
    layers 0, 1, ... in order (the random stream runs through them); :meth:`finish` draws
    what follows every layer (head scores, token ids) and builds the metadata.
    """

    def __init__(self, cfg: SynthConfig) -> None:
        shape = get_shape(cfg.preset)
        if not (0 < cfg.audio_seconds <= MAX_AUDIO_SECONDS and 1 <= cfg.decode_steps <= MAX_DECODE_STEPS):
            raise ValueError(f"audio_seconds must be in (0, {MAX_AUDIO_SECONDS:g}] and decode_steps "
                             f"in [1, {MAX_DECODE_STEPS}], got {cfg.audio_seconds:g} and "
                             f"{cfg.decode_steps}")
        self.cfg, self.shape = cfg, shape
        self.rng = np.random.default_rng(cfg.seed)
        D = shape.head_dim
        self.n_audio = n_audio = max(8, round(cfg.audio_seconds * shape.audio_tokens_per_s))
        self.a0 = cfg.n_system
        self.n_prefill = cfg.n_system + n_audio + cfg.n_text_after
        self.n_positions = self.n_prefill + cfg.decode_steps
        self.audio = slice(self.a0, self.a0 + n_audio)
        # feature layout: time code, sink, tilt, salience, BOS, noise
        self.n_freq = n_freq = max(2, D // 4)
        self.i_time = slice(0, 2 * n_freq)
        self.i_sink, self.i_tilt, self.i_sal, self.i_bos = (2 * n_freq + i for i in range(4))
        self.i_noise = slice(2 * n_freq + 4, D)
        self.n_noise = D - (2 * n_freq + 4)
        if self.n_noise < 2:
            raise ValueError(f"head_dim {D} too small for synthetic features")
        self.word_tokens = max(2.0, shape.audio_tokens_per_s * 0.35)  # ~one word
        self.code = _time_code(n_audio, n_freq, min_period=4 * self.word_tokens)
        self.salience = np.clip(self.rng.normal(0, 1, n_audio), 0, None)  # shared by heads
        self.frontier, self.word_edges, self.word_of_step = _frontier(
            self.rng, n_audio, cfg.decode_steps, cfg.tokens_per_word)
        # query positions: observation window + every decode step
        window = np.asarray(observation_window(self.n_prefill, cfg.observation_window), dtype=np.int64)
        self.qpos = np.concatenate([window, np.arange(self.n_prefill, self.n_positions)])
        self.n_window = len(window)
        # window rows at or before the audio's end draw their noise from a stream of their
        # own, so the rest of the trace is the one a window of the text after the audio gave
        self.n_early = int((window < self.a0 + n_audio).sum())
        self.early_rng = np.random.default_rng([cfg.seed, 1])
        self.roles = np.empty((shape.n_layers, shape.n_q_heads), dtype=np.int64)
        self.sharp = np.zeros((shape.n_layers, shape.n_q_heads))

    @property
    def model(self) -> ModelFacts:
        s = self.shape
        return ModelFacts(name=s.name, n_layers=s.n_layers, n_q_heads=s.n_q_heads,
                          n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                          audio_tokens_per_s=s.audio_tokens_per_s)

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(H_kv, N, D) keys, (H_q, N_q, D) queries and (H_kv, N, D) values (None unless
        stored) of ``layer``, float32."""
        s, N, D = self.shape, self.n_positions, self.shape.head_dim
        keys = np.empty((s.n_kv_heads, N, D), dtype=np.float32)
        queries = np.empty((s.n_q_heads, len(self.qpos), D), dtype=np.float32)
        values = np.empty((s.n_kv_heads, N, D), dtype=np.float32) if self.cfg.store_values else None
        for kv in range(s.n_kv_heads):
            rot = self._kv_head_keys(kv, keys, values)
            self._kv_head_queries(layer, kv, rot, queries)
        return keys, queries, values

    def _kv_head_keys(self, kv: int, keys: np.ndarray, values: np.ndarray | None) -> np.ndarray:
        """Draw KV-head ``kv``'s keys (and values) into its rows; return its rotation."""
        rng, n_audio, D = self.rng, self.n_audio, self.shape.head_dim
        tau = np.arange(n_audio)
        feat = np.zeros((self.n_positions, D))
        feat[self.audio, self.i_time] = self.code
        feat[self.audio, self.i_sink] = np.exp(-tau / 1.5)
        feat[self.audio, self.i_tilt] = 1.0 - tau / n_audio
        feat[self.audio, self.i_sal] = self.salience * rng.uniform(0.7, 1.3)
        feat[0, self.i_bos] = 1.0
        feat[:, self.i_noise] = rng.normal(0, 1, (self.n_positions, self.n_noise)) / math.sqrt(self.n_noise)
        # text / generated keys: weak time code near the frontier region is not needed
        rot, _ = np.linalg.qr(rng.normal(size=(D, D)))
        keys[kv] = feat @ rot
        if values is not None:
            values[kv] = rng.normal(0, 1, (self.n_positions, D))
        return rot

    def _kv_head_queries(self, layer: int, kv: int, rot: np.ndarray, queries: np.ndarray) -> None:
        """Draw the queries of the q-heads of KV-head ``kv`` into their rows: a role per q-head
        (mostly the group's), then its prefill-window and decode features."""
        cfg, rng = self.cfg, self.rng
        g = self.shape.n_q_heads // self.shape.n_kv_heads
        group_role = rng.choice(3, p=cfg.role_mix)
        for j in range(g):
            h = kv * g + j
            role = group_role if rng.random() < 0.75 else rng.choice(3, p=cfg.role_mix)
            self.roles[layer, h] = role
            qf = self._query_features(layer, h, role)
            # logits = qf·feat_k (before rotation); store q so that q·k/√D equals that
            queries[h] = (qf @ rot) * math.sqrt(self.shape.head_dim)

    def _query_features(self, layer: int, h: int, role: int) -> np.ndarray:
        """(N_q, D) un-rotated query features of q-head ``h`` with ``role``."""
        cfg, rng, W, n_audio = self.cfg, self.rng, self.n_window, self.n_audio
        n_decode, n_q = cfg.decode_steps, len(self.qpos)
        qf = np.zeros((n_q, self.shape.head_dim))
        # prefill window: sink + tilt + salience (+ BOS)
        qf[:W, self.i_sink] = rng.uniform(*cfg.prefill_sink)
        qf[:W, self.i_tilt] = rng.uniform(*cfg.prefill_tilt)
        qf[:, self.i_sal] = cfg.salience * rng.exponential(1.0)
        qf[:, self.i_bos] = cfg.bos_strength * rng.uniform(0.5, 1.0)
        if role == 0:  # frontier tracker (lag of up to a word)
            s = rng.uniform(*cfg.frontier_sharpness)
            self.sharp[layer, h] = s
            lag = rng.uniform(0, self.word_tokens)
            jitter = rng.normal(0, 0.3 * self.word_tokens, n_decode)
            look = np.clip(self.frontier - lag + jitter, 0, n_audio - 1)
            qf[W:, self.i_time] = s * self.code[np.round(look).astype(int)]
            qf[W:, self.i_sink] = rng.uniform(0, 0.5)
        elif role == 1:  # diffuse
            qf[W:, self.i_time] = rng.uniform(0.5, 2.0) * self.code[rng.integers(0, n_audio, n_decode)]
            qf[W:, self.i_sal] *= 0.5
        else:  # sink head
            qf[W:, self.i_sink] = rng.uniform(*cfg.sink_head_decode)
            qf[W:, self.i_tilt] = rng.uniform(0.0, 1.0)
        n_early = self.n_early
        qf[n_early:, self.i_noise] = rng.normal(0, cfg.noise, (n_q - n_early, self.n_noise))
        qf[:n_early, self.i_noise] = self.early_rng.normal(0, cfg.noise, (n_early, self.n_noise))
        return qf

    def finish(self) -> tuple[TraceMeta, pl.DataFrame, HeadScores]:
        """Metadata, position table and ground-truth head scores, once every layer is drawn."""
        s, roles = self.shape, self.roles
        L, Hkv, g = s.n_layers, s.n_kv_heads, s.n_q_heads // s.n_kv_heads
        vs_q = np.where(roles == 0, 0.35 + 0.6 * (self.sharp - 7.0) / 6.0,
                        np.where(roles == 1, 0.05, 0.02))
        vs = vs_q.reshape(L, Hkv, g).mean(-1)
        hs = np.exp(self.rng.normal(0, 0.5, (L, Hkv))) * (0.3 + vs)
        scores = HeadScores(vs, hs, source="synthetic ground truth")
        positions = self._positions()
        tok_s = 1.0 / s.audio_tokens_per_s
        meta = TraceMeta(
            model=self.model, n_positions=self.n_positions, n_prefill=self.n_prefill,
            n_decode=self.cfg.decode_steps, prompt="<synthetic>",
            generated_text=" ".join(f"w{w}" for w in np.unique(self.word_of_step)),
            audio={"duration_s": self.n_audio * tok_s, "source": "synthetic"},
            provenance={**default_provenance(), "generator": "kvsim.synth",
                        "config": _jsonable(self.cfg),
                        "roles": {r: int((roles == i).sum()) for i, r in enumerate(ROLES)}},
        )
        return meta, positions, scores

    def _positions(self) -> pl.DataFrame:
        """The per-position table (kinds, audio times, generated words, token ids)."""
        N, n_prefill, n_decode = self.n_positions, self.n_prefill, self.cfg.decode_steps
        kinds = ["text"] * N
        kinds[: self.a0] = ["system"] * self.a0
        kinds[self.audio] = ["audio"] * self.n_audio
        kinds[n_prefill:] = ["generated"] * n_decode
        tok_s = 1.0 / self.shape.audio_tokens_per_s
        tau = np.arange(self.n_audio)
        start, end, wstart, wend = (np.full(N, np.nan) for _ in range(4))
        start[self.audio] = tau * tok_s
        end[self.audio] = (tau + 1) * tok_s
        words: list[str | None] = [None] * N
        for j in range(n_decode):
            w = self.word_of_step[j]
            wstart[n_prefill + j] = self.word_edges[w] * tok_s
            wend[n_prefill + j] = self.word_edges[w + 1] * tok_s
            words[n_prefill + j] = f"w{w}"
        token_ids = self.rng.integers(10, 30000, N)
        return positions_frame(kinds, token_ids, self.qpos, start, end, words, wstart, wend)


def synthesize(cfg: SynthConfig) -> TraceData:
    """Build a synthetic trace (see module docstring) with the shape of ``cfg.preset``, in
    memory (float32 keys, queries and values of every layer; see :func:`write_synthetic` to
    write a long one with memory for one layer)."""
    syn = _Synthesizer(cfg)
    s, N, n_q = syn.shape, syn.n_positions, len(syn.qpos)
    keys = np.empty((s.n_layers, s.n_kv_heads, N, s.head_dim), dtype=np.float32)
    queries = np.empty((s.n_layers, s.n_q_heads, n_q, s.head_dim), dtype=np.float32)
    values = np.empty_like(keys) if cfg.store_values else None
    for layer in range(s.n_layers):
        keys[layer], queries[layer], layer_values = syn.layer(layer)
        if values is not None:
            values[layer] = layer_values
    meta, positions, scores = syn.finish()
    return TraceData(meta=meta, keys=keys, queries=queries, query_positions=syn.qpos,
                     positions=positions, values=values, head_scores=scores)


def write_synthetic(path: str | Path, cfg: SynthConfig, *, overwrite: bool = True) -> Path:
    """Synthesise a trace and write it to ``path``, a layer at a time: the trace of
    :func:`synthesize` (byte for byte), with memory for one layer instead of the whole trace.
    Returns the ``*.kvtrace`` path written. A directory already there is replaced, unless
    ``overwrite`` is False: then it is kept and :class:`FileExistsError` raised."""
    syn = _Synthesizer(cfg)
    with TraceWriter(path, syn.model, syn.n_positions, syn.qpos, cfg.store_values,
                     overwrite=overwrite) as writer:
        for layer in range(syn.shape.n_layers):
            writer.write_layer(layer, *syn.layer(layer))
        writer.finish(*syn.finish())
    return writer.path


def _jsonable(cfg: SynthConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
