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

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvsim.core.shapes import HeadLayout
from kvsim.replay.tensors import LayerAttention

#: ``work(key, shape, dtype)``: a work array kept between calls (:meth:`MetricAccumulator.work`)
WorkArrays = Callable[[object, tuple[int, ...], type], np.ndarray]


class LayerMass(NamedTuple):
    """Every run's attention mass at one (step, layer) (arrays (R, H_q)), or at each of a group
    of layers (arrays (G, R, H_q)), shared by the output-error and the step-attention buffers."""

    whole: np.ndarray  #: bool: the run read every audio position of the q-head's KV-head
    normaliser: np.ndarray  #: softmax normaliser of the compressed model


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

    The kept audio mass and the top-K hits of runs and q-heads, and the full audio mass, come
    out of one ``(2g·B, T_a) x (T_a, n + 1)`` product per KV-head: the left operand holds the
    q-heads' audio attention of B decode steps and the 0/1 indicator of their top-K positions;
    the right operand is the read mask of n runs plus an all-ones mask, so the full mass comes
    from the same kernel and summation as every kept mass.

    The first ``n_static`` runs read what they chose at prefill at every step (no tier update,
    no selection): they are measured once per block of decode steps (:meth:`start_block`,
    B = the block's steps, against a copy of their masks laid out for the product); the others
    step by step (:meth:`add_layers`, B = 1, a group of layers at once), with the top-K indicator of the block. Either way a
    figure is the same float32 sums of the same probabilities (the products' shapes differ, so
    the roundings may).
    """

    def __init__(self, n_runs: int, heads: HeadLayout, n_audio: int, n_steps: int,
                 topk: int, n_static: int = 0) -> None:
        n_q = heads.n_q_heads
        self.n_runs, self.n_audio, self.n_layers = n_runs, n_audio, heads.n_layers
        self.n_steps, self.group = n_steps, heads.group
        self.k_top = min(topk, n_audio)
        self.kv_of_q = np.arange(n_q) // heads.group  # KV-head of each q-head
        self.n_static = n_static
        self.static, self.dynamic = slice(0, n_static), slice(n_static, n_runs)
        #: per layer: (first step, (H_kv, g, B, T_a) bool top-K indicator) of its block
        self._top: dict[int, tuple[int, np.ndarray]] = {}
        #: per layer: the static runs' kept mass (B, S, H_q) over the block's steps
        self._static_mass: dict[int, np.ndarray] = {}
        self._static_masks: np.ndarray | None = None  # (L, H_kv, T_a, S + 1)
        self._work: dict[object, np.ndarray] = {}  # see work()
        self.recall_sum = np.zeros((n_runs, heads.n_layers, n_q))
        self.step_recall = np.zeros((n_runs, n_steps))
        self.step_jaccard = np.zeros((n_runs, n_steps))
        self.err_sum = np.zeros(n_runs)
        self.err_by_layer = np.zeros((n_runs, heads.n_layers))
        self.err_n = 0

    def set_static_masks(self, masks_with_full: np.ndarray) -> None:
        """Keep the static runs' masks (and the all-ones slot R) of ``masks_with_full``
        (L, R + 1, H_kv, T_a) in the layout of the block product, (L, H_kv, T_a, S + 1)."""
        if not self.n_static:
            return
        cols = [*range(self.n_static), self.n_runs]
        self._static_masks = np.ascontiguousarray(masks_with_full[:, cols].transpose(0, 2, 3, 1))

    def start_block(self, first_step: int, layer: int, audio_block: np.ndarray,
                    resident: np.ndarray) -> None:
        """Open the block of decode steps from ``first_step`` at ``layer``: the top-K
        indicator of its steps, and the recall and top-K Jaccard of every static run.

        Parameters
        ----------
        audio_block : (H_kv, g, B, T_a) float32
            The full attention's audio columns at the block's B steps (the steps past the
            last replayed one are ignored).
        resident : (R, H_kv) int
            Audio positions every run reads per KV-head.
        """
        n_kv, group, n_block, n_audio = audio_block.shape
        top = None
        if self.k_top < n_audio:
            top = top_k_indicator(audio_block, self.k_top,
                                  out=self.work(("top", layer), audio_block.shape, bool))
        self._top[layer] = first_step, top
        if not self.n_static:
            return
        parts = 1 if top is None else 2  # attention rows, then top-K rows
        lhs = self.work("block", (n_kv, parts, group, n_block, n_audio), np.float32)
        lhs[:, 0] = audio_block
        if top is not None:
            lhs[:, 1] = top
        prod = np.matmul(lhs.reshape(n_kv, parts * group * n_block, n_audio),
                         self._static_masks[layer])  # (H_kv, parts·g·B, S + 1)
        n_valid = min(n_block, self.n_steps - first_step)
        per_step = prod.reshape(n_kv, parts, group, n_block, -1)[:, :, :, :n_valid]
        per_step = per_step.transpose(1, 3, 4, 0, 2).reshape(parts, n_valid, -1, n_kv * group)
        static, steps = self.static, slice(first_step, first_step + n_valid)
        resident_q = resident[static][:, self.kv_of_q]  # (S, H_q)
        kept, full = per_step[0, :, :-1], per_step[0, :, -1]  # (B, S, H_q), (B, H_q)
        recall, kept = self._recall(kept, full[:, None], resident_q == n_audio)
        self.recall_sum[static, layer] += np.add.reduce(recall, axis=0)
        self.step_recall[static, steps] += row_mean(recall).T
        hits = (per_step[1, :, :-1] if top is not None
                else np.broadcast_to(resident_q, (n_valid, *resident_q.shape)))
        self.step_jaccard[static, steps] += self._jaccard(hits, resident_q).T
        self._static_mass[layer] = kept

    def add_layers(self, step: int, layers: range, audio_att: np.ndarray,
                   masks_with_full: np.ndarray, resident: np.ndarray,
                   text_mass: np.ndarray) -> LayerMass:
        """Add the recall and top-K Jaccard of every run that is not static at ``step`` and
        each of the consecutive ``layers`` (each at a step of the block opened last by
        :meth:`start_block`); return every run's attention mass there.

        The layers share one batched product and one set of elementwise operations (per
        layer the same product shape and the same operations as one layer alone, so the same
        bits); a step's figures are summed over the layers in order.

        Parameters
        ----------
        audio_att : (G, H_kv, g, T_a) float32
            The full attention's audio columns at the G layers.
        masks_with_full : (G, R + 1, H_kv, T_a) float32
            What every run read (0/1) at those layers; slot R is all ones.
        resident : (G, R, H_kv) int
            Audio positions every run read per KV-head.
        text_mass : (G, H_q) float32
            The full attention's mass on the positions that are not audio
            (:func:`non_audio_mass`).

        Returns
        -------
        LayerMass
            Its arrays (G, R, H_q), one row per layer. The normaliser is the text mass plus
            the kept audio mass, both sums of the probabilities themselves: never
            ``1 - full audio mass + kept``, whose float32 cancellation (an absolute error of
            about 6e-8) swamps the normaliser of a head that puts nearly all its mass on the
            audio and a run that evicted it, and multiplied such heads' output errors by up
            to 1e5 on a real trace.
        """
        resident_q = resident[..., self.kv_of_q]  # (G, R, H_q)
        whole = resident_q == self.n_audio
        kept_mass = np.empty(resident_q.shape, dtype=np.float32)
        for i, layer in enumerate(layers):
            first, _ = self._top[layer]
            if self.n_static:
                kept_mass[i, self.static] = self._static_mass[layer][step - first]
        if self.n_static < self.n_runs:
            kept_mass[:, self.dynamic] = self._add_dynamic(step, layers, audio_att,
                                                           masks_with_full, resident_q, whole)
        normaliser = np.where(whole, np.float32(1.0), text_mass[:, None, :] + kept_mass)
        return LayerMass(whole, normaliser)

    def _add_dynamic(self, step: int, layers: range, audio_att: np.ndarray,
                     masks_with_full: np.ndarray, resident_q: np.ndarray,
                     whole: np.ndarray) -> np.ndarray:
        """:meth:`add_layers` for the runs that are not static: one ``(parts·g, T_a) x
        (T_a, D + 1)`` product per (layer, KV-head); returns their kept masses (G, D, H_q)."""
        n_layers, n_kv = audio_att.shape[:2]
        top = self._top[layers[0]][1]  # None for every layer, or for none
        parts = 1 if top is None else 2
        lhs = self.work("step", (n_layers, n_kv, parts, self.group, self.n_audio), np.float32)
        lhs[:, :, 0] = audio_att
        if top is not None:
            for i, layer in enumerate(layers):
                first, layer_top = self._top[layer]
                lhs[i, :, 1] = layer_top[:, :, step - first]
        cols = masks_with_full[:, self.n_static:]  # the stepwise runs and the all-ones slot
        prod = np.matmul(lhs.reshape(n_layers, n_kv, parts * self.group, self.n_audio),
                         cols.transpose(0, 2, 3, 1))  # (G, H_kv, parts·g, D + 1)
        per_q = prod.reshape(n_layers, n_kv, parts, self.group, -1).transpose(
            0, 2, 4, 1, 3).reshape(n_layers, parts, prod.shape[-1], -1)  # (G, parts, D + 1, H_q)
        dynamic = self.dynamic
        read_q = resident_q[:, dynamic]
        full = per_q[:, 0, -1:]
        recall, kept = self._recall(per_q[:, 0, :-1], full, whole[:, dynamic])
        self.recall_sum[dynamic, layers.start:layers.stop] += recall.transpose(1, 0, 2)
        hits = per_q[:, 1, :-1] if top is not None else read_q
        step_recall, step_jaccard = row_mean(recall), self._jaccard(hits, read_q)  # (G, D)
        for i in range(n_layers):  # summed over the layers in order
            self.step_recall[dynamic, step] += step_recall[i]
            self.step_jaccard[dynamic, step] += step_jaccard[i]
        return kept

    def work(self, key: object, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A work array of ``shape``, the same one at every call with that key and shape
        (these arrays are large enough that a fresh allocation costs page faults each time)."""
        out = self._work.get(key)
        if out is None or out.shape != shape:
            out = self._work[key] = np.empty(shape, dtype=dtype)
        return out

    @staticmethod
    def _recall(mass: np.ndarray, full_mass: np.ndarray,
                whole: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Attention recall from the runs' masses ``mass`` (..., n, H_q) and the full mass
        (broadcast), and the kept mass: a run that reads every position of a q-head's
        KV-head (``whole``) keeps the full mass by construction (recall exactly 1)."""
        kept = np.where(whole, full_mass, mass)
        recall = np.divide(kept, full_mass, out=np.ones_like(kept), where=full_mass > 0)
        return recall, kept

    def _jaccard(self, hits: np.ndarray, resident_q: np.ndarray) -> np.ndarray:
        """Top-K Jaccard, mean over q-heads: the compressed ranking is the full one restricted
        to what the run read, so |top_full ∩ top_comp| = read hits of top_full (sums of 0/1,
        exact in float32), and |top_comp| = min(K, positions read)."""
        k_comp = np.minimum(self.k_top, resident_q)
        return row_mean(hits / np.maximum(self.k_top + k_comp - hits, 1))

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
                 non_audio: np.ndarray, masks_with_full: np.ndarray, mass: LayerMass,
                 work: WorkArrays | None = None) -> np.ndarray:
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
        As in :meth:`MetricAccumulator.add_layers`, at one layer.
    work : WorkArrays, optional
        Where the products' operands are kept between calls (:meth:`MetricAccumulator.work`).
    """
    n_kv, group, n_audio = att.audio.shape
    n_runs, n_q = masks_with_full.shape[0] - 1, n_kv * group
    out_text = _text_output(att.full.reshape(n_kv, group, -1), values, audio_index, non_audio)
    # kept attention of every run and of the full mask (slot R), KV-head-major so that each
    # KV-head's output for all of them is one ((R + 1)·g, T_a) x (T_a, D) product: a full
    # mask's error is exactly 0
    shape = (n_kv, n_runs + 1, group, n_audio)
    kept = np.multiply(att.audio[:, None], masks_with_full.transpose(1, 0, 2)[:, :, None, :],
                       out=None if work is None else work("kept", shape, np.float32))
    out_kept = np.matmul(kept.reshape(n_kv, (n_runs + 1) * group, n_audio), values[:, audio_index])
    out_all = out_text[None] + out_kept.reshape(n_kv, n_runs + 1, group, -1).transpose(1, 0, 2, 3)
    out_full = out_all[n_runs].reshape(n_q, -1)
    norm_full = np.maximum(np.linalg.norm(out_full, axis=-1), 1e-30)
    out_c = out_all[:n_runs].reshape(n_runs, n_q, -1) / mass.normaliser[..., None]
    out_c = np.where(mass.whole[..., None], out_full, out_c)  # exact, as above
    return (np.linalg.norm(out_c - out_full, axis=-1) / norm_full).mean(-1)


def non_audio_mass(full: np.ndarray, audio_index: slice | np.ndarray,
                   non_audio: np.ndarray) -> np.ndarray:
    """(H_q,) mass of the full attention ``full`` (H_q, p + 1) on the positions that are not
    audio: a sum of those probabilities (views around contiguous audio), so small masses keep
    their relative precision."""
    if isinstance(audio_index, slice):
        lo, hi = audio_index.start, min(audio_index.stop, non_audio.size)
        return np.add.reduce(full[:, :lo], axis=-1) + np.add.reduce(full[:, hi:], axis=-1)
    return np.add.reduce(full[:, non_audio], axis=-1)


def _text_output(full: np.ndarray, values: np.ndarray, audio_index: slice | np.ndarray,
                 non_audio: np.ndarray) -> np.ndarray:
    """(H_kv, g, D) attention output over the non-audio positions, from the (H_kv, g, p + 1)
    attention: views of the positions before and after contiguous audio (no copy of the
    values), else the non-audio positions gathered."""
    n = non_audio.size
    if isinstance(audio_index, slice):
        lo, hi = audio_index.start, min(audio_index.stop, n)
        return (np.matmul(full[:, :, :lo], values[:, :lo])
                + np.matmul(full[:, :, hi:], values[:, hi:n]))
    return np.matmul(full[:, :, non_audio], values[:, :n][:, non_audio])
