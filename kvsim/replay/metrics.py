"""What each replayed run keeps of the full model's attention, accumulated over steps and layers
for every run of a replay at once.

Per (step, layer) and q-head, from the full attention ``P`` and the audio a run read:

- **attention recall**: the audio attention mass the run kept, over the full audio mass;
- **top-K Jaccard**: overlap of the full model's top-K audio positions and the compressed
  model's (the full ranking restricted to what the run read);
- **output error**: ``‖o_c − o‖ / ‖o‖``, the relative error of the attention output of the
  compressed model (softmax renormalised over what it read) against the full one.

A run that reads every audio position of a KV-head computes the full model there: its kept
mass is the full mass and its normaliser 1 by construction, so its recall is exactly 1 and its
error exactly 0 whatever the CPU (a matmul row may round differently on another CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvsim.core.shapes import HeadLayout
from kvsim.replay.tensors import LayerAttention


class LayerMass(NamedTuple):
    """Every run's attention mass at one (step, layer), shared by the output-error and the
    step-attention buffers."""

    whole: np.ndarray  #: (R, H_q) bool: the run read every audio position of the q-head's KV-head
    normaliser: np.ndarray  #: (R, H_q) softmax normaliser of the compressed model


@dataclass
class RunMetrics:
    """The accumulated metrics of one run (sums over steps and layers)."""

    recall_sum: np.ndarray  #: (L, H_q) attention recall summed over steps
    step_recall: np.ndarray  #: (S,) attention recall of every step, summed over layers
    step_jaccard: np.ndarray  #: (S,) top-K Jaccard of every step, summed over layers
    err_sum: float  #: output error summed over the sampled (step, layer) pairs
    err_n: int  #: number of sampled (step, layer) pairs
    err_by_layer: np.ndarray | None = None  #: (L,) output error summed over the sampled steps


class MetricAccumulator:
    """Recall, top-K Jaccard and output error of R runs, batched over the runs.

    The kept audio mass and the top-K hits of every run and q-head, and the full audio mass,
    come out of one ``(2g, T_a) x (T_a, R + 1)`` product per KV-head: the left operand holds
    the q-heads' audio attention (rows ``[0, g)``) and the 0/1 indicator of their top-K
    positions (rows ``[g, 2g)``); the right operand is every run's read mask plus an all-ones
    mask (slot R), so the full mass comes from the same kernel and summation as every kept mass.
    """

    def __init__(self, n_runs: int, heads: HeadLayout, n_audio: int, n_steps: int,
                 topk: int) -> None:
        n_kv, group, n_q = heads.n_kv_heads, heads.group, heads.n_q_heads
        self.n_runs, self.n_audio, self.n_layers = n_runs, n_audio, heads.n_layers
        self.group = group
        self.k_top = min(topk, n_audio)
        self.kv_of_q = np.arange(n_q)[:, None] // group  # (H_q, 1): KV-head of each q-head
        self.lhs = np.zeros((n_kv, 2 * group, n_audio), dtype=np.float32)
        self.lhs_att, self.lhs_top = self.lhs[:, :group], self.lhs[:, group:]
        self.recall_sum = np.zeros((n_runs, heads.n_layers, n_q))
        self.step_recall = np.zeros((n_runs, n_steps))
        self.step_jaccard = np.zeros((n_runs, n_steps))
        self.err_sum = np.zeros(n_runs)
        self.err_by_layer = np.zeros((n_runs, heads.n_layers))
        self.err_n = 0

    def add_layer(self, step: int, layer: int, audio_att: np.ndarray,
                  masks_with_full: np.ndarray, resident: np.ndarray) -> LayerMass:
        """Add the recall and top-K Jaccard of every run at (``step``, ``layer``).

        Parameters
        ----------
        audio_att : (H_kv, g, T_a) float32
            The full attention's audio columns.
        masks_with_full : (R + 1, H_kv, T_a) float32
            What every run read (0/1); slot R is all ones.
        resident : (R, H_kv) int
            Audio positions every run read per KV-head.
        """
        n_runs, group = self.n_runs, self.group
        prod = self._mass_and_top_hits(audio_att, masks_with_full)  # (H_kv, 2g, R + 1)
        mass = prod[:, :group].reshape(-1, n_runs + 1).T  # (R + 1, H_q)
        full_mass = mass[n_runs]
        resident_q = resident[:, self.kv_of_q[:, 0]]  # (R, H_q)
        whole = resident_q == self.n_audio
        kept_mass = np.where(whole, full_mass, mass[:n_runs])
        recall = np.divide(kept_mass, full_mass, out=np.ones_like(kept_mass), where=full_mass > 0)
        self.recall_sum[:, layer] += recall
        self.step_recall[:, step] += row_mean(recall)
        self._add_jaccard(step, prod, resident_q)
        normaliser = np.where(whole, np.float32(1.0), 1.0 - full_mass + kept_mass)
        return LayerMass(whole, normaliser)

    def _mass_and_top_hits(self, audio_att: np.ndarray, masks_with_full: np.ndarray) -> np.ndarray:
        """The one product per layer: kept mass (rows ``[0, g)``) and top-K hits (rows
        ``[g, 2g)``) of every run, full mass in the last column."""
        self.lhs_att[...] = audio_att
        if self.k_top < self.n_audio:
            top_k_indicator(self.lhs_att, self.k_top, out=self.lhs_top)
        return np.matmul(self.lhs, masks_with_full.transpose(1, 2, 0))

    def _add_jaccard(self, step: int, prod: np.ndarray, resident_q: np.ndarray) -> None:
        """Top-K Jaccard: the compressed ranking is the full one restricted to what the run
        read, so |top_full ∩ top_comp| = read hits of top_full (sums of 0/1, exact in
        float32), and |top_comp| = min(K, positions read)."""
        k_top = self.k_top
        if k_top < self.n_audio:
            hits = prod[:, self.group:, :self.n_runs].reshape(-1, self.n_runs).T
        else:
            hits = resident_q
        k_comp = np.minimum(k_top, resident_q)
        self.step_jaccard[:, step] += row_mean(hits / np.maximum(k_top + k_comp - hits, 1))

    def add_output_error(self, errors: np.ndarray, layer: int | None = None) -> None:
        """Add every run's output error of one (step, ``layer``) (see :func:`output_error`)."""
        self.err_sum += errors
        if layer is not None:
            self.err_by_layer[:, layer] += errors

    def end_step(self, error_sampled: bool) -> None:
        """Close a step; ``error_sampled``: its output error was added at every layer."""
        if error_sampled:
            self.err_n += self.n_layers

    def of_run(self, r: int) -> RunMetrics:
        """The metrics of run ``r`` (views of the batched sums)."""
        return RunMetrics(self.recall_sum[r], self.step_recall[r], self.step_jaccard[r],
                          float(self.err_sum[r]), self.err_n, self.err_by_layer[r])


def top_k_indicator(scores: np.ndarray, k: int, out: np.ndarray) -> np.ndarray:
    """0/1 indicator of the ``k`` largest entries of every row of ``scores`` (last axis), into
    ``out`` (same shape, float32, any strides); ties at the k-th value go to the lowest
    positions.

    The k-th largest value of a row comes from one ``np.partition`` with a single ``kth`` (no
    index array: about a quarter of the time of ``np.argpartition``, and of a partition with
    two ``kth``), the indicator from one comparison with it; only a row where more than k
    entries reach it (a tie) needs more (rare in float32 attention).
    """
    n = scores.shape[-1]
    kth = np.partition(scores, n - k, axis=-1)[..., n - k : n - k + 1]  # (..., 1) k-th largest
    np.greater_equal(scores, kth, out=out, casting="unsafe")
    counts = np.add.reduce(out, axis=-1)  # k, or more where the k-th value is tied
    for row in zip(*np.nonzero(counts > k), strict=True):  # ties: keep the lowest positions
        tied = np.flatnonzero(scores[row] == kth[row])
        out[row][tied[k - int(counts[row]) + len(tied):]] = 0.0
    return out


def row_mean(x: np.ndarray) -> np.ndarray:
    """``x.mean(-1)`` bit for bit (the same sum, then the same division by the count), without
    the Python-level bookkeeping of ``ndarray.mean`` that costs more than the sum on rows this
    short."""
    out = np.add.reduce(x, axis=-1)
    return np.true_divide(out, np.intp(x.shape[-1]), out=out, casting="unsafe")


def output_error(att: LayerAttention, values: np.ndarray, audio_index: slice | np.ndarray,
                 non_audio: np.ndarray, masks_with_full: np.ndarray, mass: LayerMass) -> np.ndarray:
    """(R,) relative attention-output error of every run at one (step, layer), mean over q-heads.

    Parameters
    ----------
    att : LayerAttention
        The full attention of the step's query over positions ``[0, p]``.
    values : (H_kv, N, D) float32
        The layer's values.
    audio_index : slice or (T_a,) int array
        The audio positions.
    non_audio : (p + 1,) bool
        The non-audio positions up to the current one.
    masks_with_full, mass
        As in :meth:`MetricAccumulator.add_layer`.
    """
    n_kv, group, n_audio = att.audio.shape
    n_runs, n_q = masks_with_full.shape[0] - 1, n_kv * group
    out_text = np.matmul(att.full[:, non_audio].reshape(n_kv, group, -1),
                         values[:, : non_audio.size][:, non_audio])
    # kept attention of every run and of the full mask (slot R), KV-head-major so that each
    # KV-head's output for all of them is one ((R + 1)·g, T_a) x (T_a, D) product: a full
    # mask's error is exactly 0
    kept = att.audio[:, None] * masks_with_full.transpose(1, 0, 2)[:, :, None, :]
    out_kept = np.matmul(kept.reshape(n_kv, (n_runs + 1) * group, n_audio), values[:, audio_index])
    out_all = out_text[None] + out_kept.reshape(n_kv, n_runs + 1, group, -1).transpose(1, 0, 2, 3)
    out_full = out_all[n_runs].reshape(n_q, -1)
    norm_full = np.maximum(np.linalg.norm(out_full, axis=-1), 1e-30)
    out_c = out_all[:n_runs].reshape(n_runs, n_q, -1) / mass.normaliser[..., None]
    out_c = np.where(mass.whole[..., None], out_full, out_c)  # exact, as above
    return (np.linalg.norm(out_c - out_full, axis=-1) / norm_full).mean(-1)
