"""Where the decoder reads while it writes: the audio position of the attention peak per
answer token, and the jumps of that path.

A speech LLM that transcribes attends, in some of its layers, to the audio of the word it is
writing; the WnW paper's decode-cumulative distribution (§2.1) averages over those moving
peaks, consistent with its spreading over the whole clip while the prefill distribution
concentrates near the start. Reading the peak per answer token turns a trace into an alignment path. A path that
moves forward with the transcript is a model that stays aligned; a jump back re-reads audio it
has already transcribed (a repeated sentence), a jump forward skips audio (a dropped one).

* per layer: the answer tokens' attention over the audio, averaged over q-heads;
* alignment layers: those whose peak time is most monotonic in the answer step (Spearman
  correlation), unless given;
* path: the peak time of the mean distribution of those layers per answer token, median
  filtered over a few tokens (punctuation and sub-word pieces may look elsewhere);
* jumps: steps where the filtered path moves back or forward by more than a threshold;
* with the reference word times: the share of words whose written text equals a reference
  word near the peak, i.e. whether the model writes what it looks at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from kvsim.studies.mismatch import answer_audio_attention
from kvsim.trace.reader import Trace
from kvsim.trace.schema import META_FILE, TraceError
from kvsim.tracer.alignment import WordTiming, normalise


@dataclass(frozen=True)
class Jump:
    """A discontinuity of the alignment path: answer token ``step`` reads at ``to_s`` where
    the token before it read at ``from_s``."""

    step: int
    from_s: float
    to_s: float

    @property
    def seconds(self) -> float:
        return self.to_s - self.from_s


def layer_attention(trace: Trace) -> np.ndarray:
    """Attention of every answer query over the audio, averaged over q-heads and normalised
    over the audio: ``(L, n_answer, T_a)``. Answer query ``i`` sits at position
    ``n_prefill - 1 + i`` and produced the ``i``-th generated token."""
    meta = trace.meta
    if meta.n_decode == 0:
        raise TraceError(str(trace.path / META_FILE), "n_decode", "0: the trace has no answer tokens to align")
    answer = np.arange(meta.n_prefill - 1, meta.n_positions - 1)
    out = np.zeros((meta.model.n_layers, len(answer), trace.n_audio), dtype=np.float32)
    for layer, att in enumerate(answer_audio_attention(trace, answer)):
        att = att.mean(0)
        out[layer] = att / np.clip(att.sum(-1, keepdims=True), 1e-12, None)
    return out


def monotonicity(dist: np.ndarray) -> np.ndarray:
    """Spearman correlation between the answer step and the peak audio index, per layer of
    ``dist`` ``(L, n_answer, T_a)``; 0 for a layer whose peak never moves."""
    steps = np.arange(dist.shape[1], dtype=np.float64)
    out = np.zeros(dist.shape[0])
    for layer, d in enumerate(dist):
        peak = d.argmax(-1).astype(np.float64)
        if peak.std() == 0:
            continue
        ranks = pl.Series(peak).rank().to_numpy()
        out[layer] = float(np.corrcoef(steps, ranks)[0, 1])
    return out


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Running median over ``width`` samples (odd; edges use the available samples)."""
    if width <= 1:
        return x.copy()
    h = width // 2
    return np.array([np.median(x[max(0, i - h): i + h + 1]) for i in range(len(x))])


def find_jumps(times: np.ndarray, min_jump_s: float) -> list[Jump]:
    """Steps where the path ``times`` moves by more than ``min_jump_s`` from the step before."""
    d = np.diff(times)
    return [Jump(int(i + 1), float(times[i]), float(times[i + 1]))
            for i in np.flatnonzero(np.abs(d) > min_jump_s)]


def word_agreement(path: pl.DataFrame, reference: list[WordTiming], tolerance: int = 1,
                   shift_s: float = 0.0) -> float:
    """Share of written words (the first token of each) equal to a reference word within
    ``tolerance`` words of the one spoken at the token's peak time (``peak_s``, moved by
    ``shift_s`` modulo the speech's end: a shifted path gives the chance level)."""
    starts = np.array([w.start for w in reference])
    end = max(w.end for w in reference)
    refs = [normalise(w.word) for w in reference]
    new_word = pl.col("word") != pl.col("word").shift(1)
    rows = path.filter(pl.col("word").is_not_null() & new_word.fill_null(True))
    hits = n = 0
    for word, t in rows.select("word", "peak_s").iter_rows():
        t = (t + shift_s) % end if shift_s else t
        w = normalise(word)
        if not w:
            continue
        j = max(0, int(np.searchsorted(starts, t, side="right")) - 1)
        n += 1
        hits += w in refs[max(0, j - tolerance): j + tolerance + 1]
    return hits / n if n else float("nan")


def chance_agreement(path: pl.DataFrame, reference: list[WordTiming], tolerance: int = 1) -> float:
    """:func:`word_agreement` of the path shifted by 1/4, 1/2 and 3/4 of the speech (mean):
    what matching a word near the peak gives by chance (common words recur)."""
    end = max(w.end for w in reference)
    return float(np.mean([word_agreement(path, reference, tolerance, f * end)
                          for f in (0.25, 0.5, 0.75)]))


@dataclass
class Alignment:
    """The alignment path of a trace and its summary."""

    layers: list[int]
    layer_monotonicity: list[float]
    path: pl.DataFrame  # step, position, token_id, word, peak_s, path_s
    jumps: list[Jump]
    audio_seconds: float

    @property
    def back_jumps(self) -> list[Jump]:
        return [j for j in self.jumps if j.seconds < 0]

    @property
    def forward_jumps(self) -> list[Jump]:
        return [j for j in self.jumps if j.seconds > 0]

    def covered_seconds(self, bin_s: float = 2.0) -> float:
        """Seconds of audio (in ``bin_s`` bins) that the filtered path visits at least once."""
        bins = np.unique(np.floor(self.path["path_s"].to_numpy() / bin_s))
        return float(min(len(bins) * bin_s, self.audio_seconds))


def alignment(trace: Trace, layers: list[int] | None = None, n_layers: int = 4,
              smooth: int = 5, min_jump_s: float = 5.0) -> Alignment:
    """Alignment path of ``trace`` read from ``layers`` (default: the ``n_layers`` most
    monotonic), median filtered over ``smooth`` tokens, with its jumps above ``min_jump_s``."""
    dist = layer_attention(trace)
    mono = monotonicity(dist)
    if layers is None:
        layers = sorted(np.argsort(-mono, kind="stable")[:n_layers].tolist())
    bad = [x for x in layers if not 0 <= x < dist.shape[0]]
    if bad:
        raise ValueError(f"no layer {bad[0]} (the model has {dist.shape[0]})")
    starts = trace.positions["audio_start_s"].to_numpy()[trace.audio_positions]
    peak_s = starts[dist[layers].mean(0).argmax(-1)]
    path_s = median_filter(peak_s, smooth)
    meta = trace.meta
    gen = trace.positions.filter(pl.col("position") >= meta.n_prefill).sort("position")
    n = len(peak_s)
    path = pl.DataFrame({
        "step": np.arange(n), "position": gen["position"][:n], "token_id": gen["token_id"][:n],
        "word": gen["word"][:n], "peak_s": peak_s, "path_s": path_s})
    return Alignment(layers=list(layers), layer_monotonicity=[float(mono[x]) for x in layers],
                     path=path, jumps=find_jumps(path_s, min_jump_s),
                     audio_seconds=float(trace.audio_seconds))
