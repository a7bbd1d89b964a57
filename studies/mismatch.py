"""WnW §2.1 prefill–decode attention mismatch, measured on a trace.

* prefill distribution: attention of the first answer token (the prompt's last position)
  over the audio, averaged over layers and q-heads, normalised over the audio;
* decode-cumulative distribution: the same averaged over every answer token (the prefill
  query and every decode step);
* mass in the first 10% / first half of the audio (and of the speech, from its onset);
* Jaccard of the top-K audio positions of the two distributions, overall and per KV-head.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from kvsim.core.attention import as_f32, causal_attention
from kvsim.trace.reader import Trace

#: Figures the WnW paper reports on Voxtral-mini-3b, LibriSpeech-Long dev-clean (§2.1).
PAPER_VOXTRAL = {
    "prefill_first10": 0.479,
    "prefill_first_half": 0.693,
    "decode_first10": 0.098,
    "decode_first_half": 0.477,
    "jaccard_top100": 0.187,
    "jaccard_top500": 0.240,
    "head_jaccard_min": 0.006,
    "head_jaccard_max": 0.641,
    "head_jaccard_below_01": 0.27,  # share of heads with Jaccard < 0.1
}


@dataclass
class MismatchStats:
    n_audio: int
    prefill_first10: float
    prefill_first_half: float
    decode_first10: float
    decode_first_half: float
    jaccard_top100: float
    jaccard_top500: float
    random_jaccard_top100: float
    head_jaccard_min: float
    head_jaccard_max: float
    head_jaccard_below_01: float
    speech_onset_index: int = -1  # -1: the trace has no word timings
    prefill_first10_speech: float = float("nan")
    decode_first10_speech: float = float("nan")

    def as_dict(self) -> dict:
        return asdict(self)


def _jaccard(a: np.ndarray, b: np.ndarray, k: int) -> float:
    k = min(k, len(a))
    ta = set(np.argsort(-a, kind="stable")[:k].tolist())
    tb = set(np.argsort(-b, kind="stable")[:k].tolist())
    return len(ta & tb) / len(ta | tb)


def _first_frac(p: np.ndarray, frac: float, start: int = 0) -> float:
    p = p[start:]
    n = max(1, int(round(frac * len(p))))
    return float(p[:n].sum() / p.sum())


def answer_audio_attention(trace: Trace, positions: np.ndarray) -> Iterator[np.ndarray]:
    """Per layer, the attention of the recorded queries at ``positions`` over the audio keys,
    ``(H_q, M, T_a)``, not renormalised over the audio."""
    audio = trace.audio_positions
    rows = np.array([trace.query_index(int(p)) for p in positions])
    for layer in range(trace.meta.model.n_layers):
        q = as_f32(trace.queries(layer)[:, rows])
        yield causal_attention(q, as_f32(trace.keys(layer)), positions)[:, :, audio]


def head_distributions(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per-KV-head prefill and decode-cumulative audio distributions, each (L, H_kv, T_a),
    normalised to sum 1 over the audio."""
    meta = trace.meta
    g = meta.model.n_q_heads // meta.model.n_kv_heads
    first = meta.n_prefill - 1  # the query that produced the first answer token
    answer_pos = np.arange(first, meta.n_positions)
    L, Hkv = meta.model.n_layers, meta.model.n_kv_heads
    pre = np.zeros((L, Hkv, trace.n_audio))
    dec = np.zeros((L, Hkv, trace.n_audio))
    for layer, att in enumerate(answer_audio_attention(trace, answer_pos)):  # (H_q, M, T_a)
        att /= att.sum(-1, keepdims=True)
        pre[layer] = att[:, 0].reshape(Hkv, g, -1).mean(1)
        dec[layer] = att.mean(1).reshape(Hkv, g, -1).mean(1)
    return pre, dec


def speech_onset(trace: Trace) -> int | None:
    """Index (within the audio) of the first audio token at or after the first word start;
    None when the trace has no word timing."""
    pos = trace.positions
    ws = pos["word_start_s"].drop_nulls()
    if ws.len() == 0:
        return None
    t0 = float(ws.min())
    starts = pos["audio_start_s"].to_numpy()[trace.audio_positions]
    return int(np.searchsorted(starts, t0 - 1e-9))


def head_jaccard(pre_h: np.ndarray, dec_h: np.ndarray, k: int = 100) -> np.ndarray:
    """Per-KV-head top-``k`` Jaccard of the prefill and decode-cumulative distributions
    (each (L, H_kv, T_a), from :func:`head_distributions`); returns (L, H_kv)."""
    return np.array([[_jaccard(pre_h[layer, kv], dec_h[layer, kv], k) for kv in range(pre_h.shape[1])]
                     for layer in range(pre_h.shape[0])])


def mismatch(trace: Trace, distributions: tuple[np.ndarray, np.ndarray] | None = None) -> MismatchStats:
    """Compute the §2.1 statistics of one trace (``distributions``: its
    :func:`head_distributions`, when the caller has them already)."""
    pre_h, dec_h = distributions if distributions is not None else head_distributions(trace)
    pre = pre_h.mean((0, 1))
    dec = dec_h.mean((0, 1))
    n = len(pre)
    per_head = head_jaccard(pre_h, dec_h, 100).ravel()
    onset = speech_onset(trace)
    nan = float("nan")
    return MismatchStats(
        n_audio=n,
        prefill_first10=_first_frac(pre, 0.1),
        prefill_first_half=_first_frac(pre, 0.5),
        decode_first10=_first_frac(dec, 0.1),
        decode_first_half=_first_frac(dec, 0.5),
        jaccard_top100=_jaccard(pre, dec, 100),
        jaccard_top500=_jaccard(pre, dec, 500),
        random_jaccard_top100=min(100, n) / n / (2 - min(100, n) / n),
        head_jaccard_min=float(per_head.min()),
        head_jaccard_max=float(per_head.max()),
        head_jaccard_below_01=float((per_head < 0.1).mean()),
        speech_onset_index=-1 if onset is None else onset,
        prefill_first10_speech=nan if onset is None else _first_frac(pre, 0.1, onset),
        decode_first10_speech=nan if onset is None else _first_frac(dec, 0.1, onset),
    )
