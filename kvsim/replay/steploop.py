"""The decode steps of a replay: every run of the batch advanced together, one attention pass
per (step, layer) shared by all of them.

Every run's read mask lives in one array, layer-major, so that what a layer reads of every run
is one contiguous block and the metrics of all runs are a handful of batched numpy calls per
layer and step, whatever the number of runs. Slot R of that array holds ones: the full model.
The runs whose reads are fixed at prefill (:func:`is_static`: SnapKV, StreamingLLM, ...) take
the first slots and are measured once per block of decode steps that the attention pass
computes together; the others, and the all-ones slot, form the contiguous tail read at every
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies.base import HeadLayout, Policy
from kvsim.replay.buffers import StepAttentionBuffers
from kvsim.replay.metrics import (
    LayerMass,
    MetricAccumulator,
    RunMetrics,
    non_audio_mass,
    output_error,
)
from kvsim.replay.runstate import PolicyRun
from kvsim.replay.selection import QueryAwareSelection
from kvsim.replay.tensors import TraceTensors


@dataclass(frozen=True)
class LoopSettings:
    """What the step loop needs of the replay configuration."""

    n_steps: int  #: decode steps replayed
    n_audio: int  #: T_a, audio positions per (layer, KV-head)
    n_prefill: int  #: prompt positions: decode step s is at position n_prefill + s
    topk: int  #: K of the top-K Jaccard
    error_stride: int  #: output error on every error_stride-th step
    check_invariants: bool
    #: work memory of the layers whose stepwise metrics are computed together (:func:`layer_groups`)
    layer_group_bytes: int = 16 * 2**20


def share_gpu_masks(runs: list[PolicyRun], heads: HeadLayout,
                    n_audio: int) -> tuple[np.ndarray, np.ndarray]:
    """Move every run's GPU mask and resident counts into arrays shared by all runs.

    Returns ``masks_with_full`` (L, R + 1, H_kv, T_a) float32, slot R all ones, and
    ``resident`` (L, R, H_kv); each run's ``gpu_mask`` and ``resident`` become its slots.
    """
    n_runs = len(runs)
    masks = np.zeros((heads.n_layers, n_runs + 1, heads.n_kv_heads, n_audio), dtype=np.float32)
    masks[:, n_runs] = 1.0
    resident = np.zeros((heads.n_layers, n_runs, heads.n_kv_heads), dtype=np.int64)
    for r, run in enumerate(runs):
        masks[:, r], resident[:, r] = run.gpu_mask, run.resident
        run.gpu_mask, run.resident = masks[:, r], resident[:, r]
    return masks, resident


def changes_tiers(run: PolicyRun) -> bool:
    """Whether a run's tiers may change after prefill (or are recorded): it then needs a
    tier update at every step."""
    return (run.policy.query_aware or run.history is not None
            or type(run.policy).decode_step is not Policy.decode_step)


def is_static(run: PolicyRun) -> bool:
    """Whether what a run reads is fixed at prefill: no tier update and no step attention
    to fill (its metrics can then be taken a block of steps at a time)."""
    return not (changes_tiers(run) or run.policy.needs_step_attention)


class StepLoop:
    """Replays the decode steps of a batch of prefilled runs."""

    def __init__(self, tensors: TraceTensors, runs: list[PolicyRun], heads: HeadLayout,
                 settings: LoopSettings) -> None:
        n_audio = settings.n_audio
        # the runs with fixed reads first: the others' masks and the all-ones slot are then one
        # contiguous block of the shared mask array, read at every step
        static = [is_static(run) for run in runs]
        self.order = sorted(range(len(runs)), key=lambda r: not static[r])
        runs = [runs[r] for r in self.order]
        self.tensors, self.runs, self.heads, self.settings = tensors, runs, heads, settings
        # a query-aware run's slot of a layer holds, during the step, what its selection read
        # there (written before use); its tiers live in the run
        self.masks_with_full, self.resident = share_gpu_masks(runs, heads, n_audio)
        self.selection = QueryAwareSelection(runs, tensors.audio_keys())
        self.buffers = StepAttentionBuffers(runs, heads, n_audio)
        self.metrics = MetricAccumulator(len(runs), heads, n_audio, settings.n_steps,
                                         settings.topk, n_static=sum(static))
        self.metrics.set_static_masks(self.masks_with_full)
        self.reads = np.zeros((settings.n_steps, len(runs)), dtype=np.int64)  # audio read
        self.stepping = [run for run in runs if changes_tiers(run)]
        self.layer_groups = layer_groups(heads, n_audio, settings.layer_group_bytes)

    def run(self) -> list[RunMetrics]:
        """Replay every step; complete the runs' step logs; return their metrics, in the
        order of the runs given."""
        for step in range(self.settings.n_steps):
            self.step(step)
        for r, run in enumerate(self.runs):
            run.log.record_reads(self.reads[:, r])
            if not changes_tiers(run):  # the prefill counts hold at every step
                run.log.record_constant_tiers(run.n_gpu, run.n_cpu)
        metrics: list[RunMetrics] = [None] * len(self.runs)  # type: ignore[list-item]
        for slot, given in enumerate(self.order):
            metrics[given] = self.metrics.of_run(slot)
        return metrics

    def step(self, step: int) -> None:
        """One decode step: selections, every layer's attention pass and metrics, tier updates."""
        cfg = self.settings
        position = cfg.n_prefill + step
        error_sampled = self.tensors.values is not None and step % cfg.error_stride == 0
        non_audio = self.tensors.non_audio[: position + 1]
        queries = self.tensors.step_queries(position)
        self.selection.select_step(step, queries, self.masks_with_full, self.resident)
        for layers in self.layer_groups:
            self.layers(step, layers, queries, non_audio, error_sampled)
        self.metrics.end_step(error_sampled)
        if cfg.check_invariants:
            self.selection.check_reads(self.masks_with_full, step)
        for run in self.stepping:
            run.end_step(step, cfg.check_invariants)

    def _start_block_at(self, step: int, layer: int, position: int, resident: np.ndarray) -> None:
        """At the first step of a block of decode steps (every step with blocks of one):
        the block's top-K indicator and the metrics of the runs with fixed reads."""
        first, block = self.tensors.block(layer)  # (H_q, B, n)
        if first != position:
            return
        audio = block[:, :, self.tensors.audio_index]  # (H_q, B, T_a)
        n_kv = self.heads.n_kv_heads
        self.metrics.start_block(step, layer, audio.reshape(n_kv, -1, *audio.shape[1:]), resident)

    def layers(self, step: int, layers: range, queries: list[np.ndarray], non_audio: np.ndarray,
               error_sampled: bool) -> None:
        """The attention pass of ``step`` at each of the consecutive ``layers`` and every run's
        metrics there, the recall and top-K Jaccard of the stepwise runs batched over the
        layers."""
        position = non_audio.size - 1
        n_runs, rows = len(self.runs), slice(layers.start, layers.stop)
        atts = [self.tensors.attention(queries[layer], layer, position, self.heads.group)
                for layer in layers]
        audio = self.metrics.work("audio", (len(layers), *atts[0].audio.shape), np.float32)
        for i, layer in enumerate(layers):
            resident = self.resident[layer]  # (R, H_kv)
            self._start_block_at(step, layer, position, resident)
            self.selection.select_layer(step, layer, queries[layer],
                                        self.masks_with_full[layer, :n_runs], resident)
            audio[i] = atts[i].audio
        self.reads[step] += self.resident[rows].sum(axis=(0, 2))
        text_mass = np.stack([non_audio_mass(att.full, self.tensors.audio_index, non_audio)
                              for att in atts])
        mass = self.metrics.add_layers(step, layers, audio, self.masks_with_full[rows],
                                       self.resident[rows], text_mass)
        self.buffers.fill_layers(layers, audio, self.masks_with_full[rows, :n_runs],
                                 mass.normaliser)
        for i, layer in enumerate(layers):
            masks_with_full = self.masks_with_full[layer]  # (R + 1, H_kv, T_a), contiguous
            if error_sampled:
                errors = output_error(atts[i], self.tensors.values[layer],
                                      self.tensors.audio_index, non_audio, masks_with_full,
                                      LayerMass(mass.whole[i], mass.normaliser[i]),
                                      self.metrics.work)
                self.metrics.add_output_error(errors, layer)


def layer_groups(heads: HeadLayout, n_audio: int, group_bytes: int) -> list[range]:
    """Consecutive layers whose stepwise metrics are computed together: as many as keep the
    work arrays of a group (its audio attention and the product's operand, about
    3 × H_q × T_a float32 per layer) within ``group_bytes``, in groups of near-equal size
    (one layer per group from the audio length where one layer alone exceeds it)."""
    per_layer = 3 * heads.n_q_heads * n_audio * 4
    most = max(1, group_bytes // per_layer)
    n_groups = -(-heads.n_layers // most)
    bounds = np.linspace(0, heads.n_layers, n_groups + 1).round().astype(int)
    return [range(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
