"""One live decoding run of one policy: the views a policy sees, the tiers it sets, the
step log it leaves.

It drives the *same* policy objects through the *same* protocol as the replay engine
(``kvsim/replay/engine.py``, ``policies/base.py``), closed loop:

* prefill runs with full attention; the session records the post-RoPE queries of the
  observation window (the last ``window`` prompt positions, 32 by default as AudioKV's in
  WnW App. F, audio included when fewer text positions follow the audio) and the prompt
  keys, and hands the
  policy a :class:`kvsim.replay.engine.WindowPrefillView` (the engine's own) whose
  ``audio_attention`` is the full-model causal softmax of those queries over the prompt,
  restricted to audio columns (H_q, W, T_a);
* at decode step ``s`` and layer ``l`` a query-aware policy's ``select`` is called before
  attention (its mask, or the GPU tier, is what attention reads); attention then runs with the
  per-(layer, KV-head) keep-mask merged in (:class:`kvsim.live.keepmask.KeepMasks`: kept
  between steps, its audio columns rewritten only when what is read there changes); when the
  policy asks for it the compressed softmax restricted to audio columns is captured (H_q, T_a),
  at the layers its ``decode_step`` reads (``step_attention_layers``; NaN elsewhere);
* after all layers ``decode_step`` (or ``current_tiers`` for query-aware policies, as the
  engine does) returns the tiers that take effect at step ``s + 1``;
* with a read window (:mod:`kvsim.decoding.read_window`, a decoding option) its aligning layers
  read only the window of what the policy keeps and selects, and their attention moves the
  window's read position.

Invariants are checked as in the engine: tier dtype/shape, GONE absorbing, capacity, the select
mask within the GPU tier.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kvsim.core.invariants import InvariantViolation, check_tiers
from kvsim.core.views import WindowPrefillView
from kvsim.decode_attention import (
    masked_attention_probs,
    masked_decode_attention,
    stock_attention,
)
from kvsim.decoding.read_window import ReadWindow
from kvsim.live.keepmask import KeepMasks
from kvsim.policies.base import (
    TIER_CPU,
    TIER_GONE,
    TIER_GPU,
    ArrayQueryView,
    BufferStepView,
    Policy,
    PolicyContext,
)
from kvsim.trace.schema import OBSERVATION_WINDOW, observation_window


def _all_visible(mask: torch.Tensor) -> bool:
    """True when an attention mask hides nothing (bool: all True; additive: all zero)."""
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _runs_per_layer(mask: np.ndarray) -> np.ndarray:
    starts = mask[..., 1:] & ~mask[..., :-1]
    return starts.sum(axis=(1, 2)) + mask[..., 0].sum(axis=1)


class LiveSession:
    """The controller the live attention function calls into (see :mod:`kvsim.live.attention`).

    Parameters
    ----------
    policy : Policy
        A fresh policy object (one per run).
    ctx : PolicyContext
        Shapes, audio count, calibration scores.
    audio_positions : (T_a,) absolute prompt positions of the audio, sorted
    n_prompt : number of prompt positions
    label : name used in error messages
    physical : bool
        Physical offload (:mod:`kvsim.live.offload`) instead of masking emulation.
    window : int
        Observation window: queries of the last ``window`` prompt positions are recorded.
    device_select : bool
        Let a policy that can (``selects_on_device``: ArkVale) select on the model's device
        on the masking path; False selects on the host with ``select`` (NumPy).
    read_window : ReadWindow or None
        A decoding option (:mod:`kvsim.decoding.read_window`): at its aligning layers attention
        reads only the audio inside the window of what the policy keeps (and selects), and
        that attention moves the window's read position. None: the policy alone.
    """

    def __init__(self, policy: Policy, ctx: PolicyContext, audio_positions: np.ndarray,
                 n_prompt: int, label: str = "", physical: bool = False,
                 check_invariants: bool = True, window: int = OBSERVATION_WINDOW,
                 device_select: bool = False, read_window: ReadWindow | None = None) -> None:
        self.policy = policy
        self.read_window = read_window
        self.ctx = ctx
        self.label = label or policy.describe()
        self.audio = np.asarray(audio_positions, dtype=np.int64)
        if len(self.audio) == 0:
            raise ValueError("the prompt has no audio positions; nothing to compress")
        self.n_prompt = n_prompt
        self.window = np.asarray(observation_window(n_prompt, window), dtype=np.int64)
        self.physical = physical
        self.check = check_invariants
        #: selection on the model's device (masking path; the physical path moves pages by
        #: the host's tiers at every layer, so it selects on the host; a policy that reads the
        #: step attention would read it back at every layer anyway)
        self.device_select = (device_select and policy.query_aware and policy.selects_on_device
                              and not physical and not policy.needs_step_attention)
        self._device_reads: list[torch.Tensor | None] = [None] * ctx.heads.n_layers
        h = ctx.heads
        self.shape = (h.n_layers, h.n_kv_heads, ctx.n_audio)
        self.phase = "prefill"
        self.step = -1
        self._pq: list[np.ndarray | None] = [None] * h.n_layers
        self._pk: list[np.ndarray | None] = [None] * h.n_layers
        self.audio_keys: list[np.ndarray] = []
        self.tiers: np.ndarray | None = None
        self.gpu: np.ndarray | None = None
        self.read = np.zeros(self.shape, dtype=bool)
        self.buffer = (np.zeros((h.n_layers, h.n_q_heads, ctx.n_audio), dtype=np.float32)
                       if policy.needs_step_attention else None)
        self.rows: list[dict[str, Any]] = []
        self.policy_seconds = 0.0
        self.cache = None  # set by the decoder when physical
        self._audio_t: torch.Tensor | None = None
        self._keep = KeepMasks(self.audio, h.n_layers)
        #: per layer: whether the policy's ``decode_step`` reads its step attention (the
        #: others are NaN, so that a wrong read shows), set after prefill
        self._buffered = np.ones(h.n_layers, dtype=bool)

    # ------------------------------------------------------------------ attention hook
    def attention(self, module, layer: int, query, key, value, attention_mask, **kwargs):
        if self.phase == "prefill":
            if query.shape[2] > 1:
                self._record_prefill(layer, query, key)
            return stock_attention(module, query, key, value, attention_mask, **kwargs)
        if query.shape[0] != 1 or query.shape[2] != 1:
            raise RuntimeError("live decoding runs batch size 1, one token per step")
        return self._decode_attention(module, layer, query, key, value, attention_mask, **kwargs)

    def _record_prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        w = torch.as_tensor(self.window, device=query.device)
        self._pq[layer] = query[0].index_select(1, w).detach().float().cpu().numpy()
        self._pk[layer] = key[0, :, : self.n_prompt].detach().float().cpu().numpy()

    def _decode_attention(self, module, layer, query, key, value, attention_mask, **kwargs):
        policy = self.policy
        if attention_mask is not None and self.step == 0 and not _all_visible(attention_mask):
            raise RuntimeError("live decoding supports unpadded batch-1 prompts only")
        if self.device_select:
            return self._device_select_attention(module, layer, query, key, value, **kwargs)
        gpu_l = self.gpu[layer]
        read = gpu_l
        if policy.query_aware:
            t0 = time.perf_counter()
            q_np = query[0, :, 0, :].detach().float().cpu().numpy()
            sel = policy.select(ArrayQueryView(self.step, layer, q_np, self.audio_keys[layer]))
            self.policy_seconds += time.perf_counter() - t0
            cur = policy.current_tiers()
            if cur is not None:
                gpu_l = cur[layer] == TIER_GPU
                self.gpu[layer] = gpu_l
            if sel is not None:
                if self.check and (sel & ~gpu_l).any():
                    raise InvariantViolation(
                        f"{self.label}: select() read audio that is not on GPU "
                        f"(step {self.step}, layer {layer})")
                read = sel
        aligning = self._aligning(layer)
        if aligning:
            read = self.read_window.restrict(read)
        self.read[layer] = read
        scaling = kwargs.get("scaling", module.scaling)
        if self.physical:
            off = self.cache.layers[layer]
            key, value = off.sync(gpu_l)
            keep = off.keep_mask(read)
            attention_mask = None  # built for the logical length; one decode query sees all keys
        else:
            keep = self._keep.get(layer, read, key.shape[2], key.device)
        if keep is None:
            out = stock_attention(module, query, key, value, attention_mask, **kwargs)
        else:
            out = (masked_decode_attention(query, key, value, keep, scaling), None)
        buffered = self.buffer is not None and self._buffered[layer]
        if buffered or aligning:
            probs = masked_attention_probs(query, key, keep, scaling)
            cols = (self.cache.layers[layer].audio_columns(probs) if self.physical
                    else probs[:, self._audio_index(probs.device)])
            if buffered:
                self.buffer[layer] = cols.cpu().numpy()
            if aligning:
                self.read_window.observe(layer, cols)
        return out

    def _aligning(self, layer: int) -> bool:
        """Whether ``layer`` is an aligning layer of the read window (False without one)."""
        return self.read_window is not None and layer in self.read_window.config.layers

    def _device_select_attention(self, module, layer, query, key, value, **kwargs):
        """Decode attention of a policy that selects on the model's device
        (``selects_on_device``): its read mask never leaves the device during the step."""
        t0 = time.perf_counter()
        read = self.policy.select_device(layer, query[0, :, 0, :].detach(), self.audio_keys[layer])
        self.policy_seconds += time.perf_counter() - t0
        aligning = self._aligning(layer)
        if aligning:
            read = self.read_window.restrict(read)
        self._device_reads[layer] = read
        keep = self._keep.get_device(layer, read, key.shape[2])
        scaling = kwargs.get("scaling", module.scaling)
        if aligning:
            probs = masked_attention_probs(query, key, keep, scaling)
            self.read_window.observe(layer, probs[:, self._audio_index(probs.device)])
        return masked_decode_attention(query, key, value, keep, scaling), None

    def _collect_device_reads(self) -> None:
        """After a step selected on the device: the policy's tiers and the step's reads back
        on the host (one transfer each), the reads checked against the GPU tier."""
        self.policy.sync_device_state()
        self.read = torch.stack(self._device_reads).cpu().numpy()  # stack: a new tensor
        if not self.check:
            return
        off_gpu = (self.read & (self.policy.current_tiers() != TIER_GPU)).any(axis=(1, 2))
        if off_gpu.any():
            layer = int(np.flatnonzero(off_gpu)[0])
            raise InvariantViolation(f"{self.label}: select() read audio that is not on GPU "
                                     f"(step {self.step}, layer {layer})")

    def _audio_index(self, device: torch.device) -> torch.Tensor:
        if self._audio_t is None or self._audio_t.device != device:
            self._audio_t = torch.as_tensor(self.audio, device=device)
        return self._audio_t

    # ------------------------------------------------------------------ lifecycle
    def finish_prefill(self) -> np.ndarray:
        """Hand the policy its prefill view; return the initial tiers."""
        if any(q is None for q in self._pq):
            raise RuntimeError("prefill attention was not captured: is the model using the "
                               f"'{'kvsim_live'}' attention on its text decoder?")
        view = WindowPrefillView(self._pq.__getitem__, self._pk, self.window, self.audio)
        self.audio_keys = [view.audio_keys(layer) for layer in range(self.shape[0])]
        t0 = time.perf_counter()
        tiers = self.policy.prefill(self.ctx, view)
        self.policy_seconds += time.perf_counter() - t0
        check_tiers(self.label, tiers, self.shape)
        self.tiers = tiers.copy()
        self.gpu = tiers == TIER_GPU
        self._check_capacity(-1)
        layers = self.policy.step_attention_layers()
        if self.buffer is not None and layers is not None:
            self._buffered[:] = False
            self._buffered[list(layers)] = True
            self.buffer[~self._buffered] = np.nan
        self.prefill_r_gpu = float(self.gpu.mean())
        self._pq = self._pk = []  # free the prompt keys and window queries
        self.phase = "decode"
        return self.tiers

    def begin_step(self, step: int) -> None:
        self.step = step

    def end_step(self, step: int, position: int) -> None:
        """After all layers of decode step ``step`` (query at ``position``): let the policy
        update its tiers and log the step in the STEP_LOG_COLUMNS format."""
        policy, prev = self.policy, self.tiers
        if self.device_select:
            self._collect_device_reads()
        t0 = time.perf_counter()
        if policy.query_aware:
            new = policy.current_tiers()
        else:
            new = policy.decode_step(BufferStepView(step, self.buffer))
        self.policy_seconds += time.perf_counter() - t0
        L = self.shape[0]
        row: dict[str, Any] = {"step": step, "context_tokens": position + 1,
                               "non_audio_tokens": position + 1 - self.ctx.n_audio}
        if new is None or (new is prev and not policy.query_aware):
            h2d_layer = runs_layer = [0] * L
            released = 0
        else:
            check_tiers(self.label, new, prev.shape)
            if self.check and ((prev == TIER_GONE) & (new != TIER_GONE)).any():
                raise InvariantViolation(
                    f"{self.label}: a GONE position came back at step {step} (GONE is absorbing)")
            recalled = (prev == TIER_CPU) & (new == TIER_GPU)
            h2d_layer = recalled.sum(axis=(1, 2)).tolist()
            runs_layer = _runs_per_layer(recalled).tolist()
            released = int(((prev == TIER_GPU) & (new != TIER_GPU)).sum())
            self.tiers = new.copy()
            self.gpu = new == TIER_GPU
            self._check_capacity(step)
        h2d = int(sum(h2d_layer))
        heads = self.ctx.heads
        row.update(
            gpu_audio_tokens=int(self.gpu.sum()),
            cpu_audio_tokens=int((self.tiers == TIER_CPU).sum()),
            read_audio_tokens=int(self.read.sum()),
            h2d_tokens=h2d,
            h2d_bytes=h2d * 2 * heads.head_dim * self.dtype_bytes,
            h2d_transfers=int(sum(runs_layer)),
            h2d_tokens_by_layer=[int(x) for x in h2d_layer],
            h2d_transfers_by_layer=[int(x) for x in runs_layer],
            released_tokens=released,
        )
        self.rows.append(row)

    dtype_bytes: int = 2

    def _check_capacity(self, step: int) -> None:
        cap = self.policy.gpu_capacity()
        if cap is not None and self.check:
            n = int(self.gpu.sum())
            if n > cap:
                raise InvariantViolation(
                    f"{self.label}: {n} GPU audio tokens exceed its capacity {cap} at step {step}")
