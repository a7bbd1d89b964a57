"""The Policy protocol: what every KV-cache policy sees and decides.

A policy manages the *audio* span of the KV cache only (WnW §3.3, "audio-only compression
constraint"): every non-audio position (system prompt, text prompt, generated tokens) stays on
GPU. For every (layer, KV-head) each audio position is in exactly one :class:`Tier`.

The same policy object is driven by the replay engine (``kvsim.replay``) and by live decoding
(``kvsim.live``); it must not know which. It therefore sees the world only through the small
views defined here:

* :class:`PolicyContext` -- shapes, audio layout, budget, optional per-head calibration scores;
* :class:`PrefillView` -- attention of the prompt's observation window over the audio, and the
  audio keys (for page digests);
* :class:`StepView` -- after a decode step, the attention the *compressed* model computed on
  the audio (renormalised over what it could see), per layer;
* an optional per-layer, query-aware :meth:`Policy.select` hook (Quest / ArkVale page scoring),
  called before attention of that layer is computed.

Tier arrays have shape ``(n_layers, n_kv_heads, n_audio)`` and dtype ``uint8``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

# the protocol's shared types live in the core (one definition); re-exported here so that a
# policy needs one import
from kvsim.core.shapes import HeadLayout, HeadScores
from kvsim.core.tiers import TIER_CPU, TIER_DTYPE, TIER_GONE, TIER_GPU, Tier
from kvsim.core.views import (
    ArrayQueryView,
    ArrayStepQueryView,
    BufferStepView,
    PrefillView,
    QueryView,
    StepQueryView,
    StepView,
    all_audio_attention,
    shared,
)

__all__ = [
    "TIER_CPU", "TIER_DTYPE", "TIER_GONE", "TIER_GPU", "ArrayQueryView", "ArrayStepQueryView",
    "BufferStepView", "HeadLayout", "HeadScores", "MissingCalibrationError", "Policy",
    "PolicyContext", "PolicyNotApplicable", "PrefillView", "QueryView", "StepQueryView",
    "StepView", "Tier", "all_audio_attention", "descending_ranks", "full_tiers",
    "kv_group_sum", "shared", "topk_from_ranks", "topk_mask",
]




@dataclass(frozen=True)
class PolicyContext:
    """Everything static a policy may know about one run."""

    heads: HeadLayout
    n_audio: int  #: T_a, number of audio KV positions
    audio_tokens_per_s: float  #: r_tok
    n_prefill: int  #: number of prompt positions (audio included)
    head_scores: HeadScores | None = None
    seed: int = 0

    @property
    def audio_kv_total(self) -> int:
        """N_full^audio = L * H_kv * T_a (WnW §3.4)."""
        return self.heads.n_layers * self.heads.n_kv_heads * self.n_audio

    def budget_tokens(self, r_gpu: float) -> int:
        """Total GPU-resident audio KV tokens allowed at target ``r_gpu``."""
        return int(math.floor(r_gpu * self.audio_kv_total + 1e-9))

    def require_head_scores(self, policy: str) -> HeadScores:
        """Return the calibration scores or raise a message that says how to get them."""
        if self.head_scores is None:
            raise MissingCalibrationError(
                f"policy {policy!r} needs per-head calibration scores (voice score and head "
                "sensitivity, WnW §2.2). The trace carries none: pass --calibration heads.json "
                "(made by `kvsim calibrate --model M AUDIO... --out heads.json`), or trace with "
                "`kvsim trace --calibrate`; synthetic traces from `kvsim synth` carry them, and "
                "minivox's own (for its shipped adapter) are minivox/heads.json."
            )
        hs = self.head_scores
        want = (self.heads.n_layers, self.heads.n_kv_heads)
        if hs.voice_score.shape != want:
            raise MissingCalibrationError(
                f"policy {policy!r}: the calibration scores have shape {hs.voice_score.shape}, this "
                f"model has (L, H_kv)={want}; pass the heads.json calibrated on this model"
            )
        return hs


class PolicyNotApplicable(RuntimeError):
    """A policy cannot run on this input as configured (e.g. its budget holds no page of the
    audio). Replay and live report it for that (input, policy, budget) and go on with the
    others, instead of running the policy empty."""


class MissingCalibrationError(PolicyNotApplicable):
    """A policy that needs head scores was run without them, or with another model's."""


@dataclass
class Policy(abc.ABC):
    """Base class of every policy. Subclasses are dataclasses whose fields are their
    hyperparameters; ``budget`` is the target audio retention r_GPU (WnW §3.4).

    Lifecycle, per (trace or live input, budget): ``prefill`` once, then ``decode_step`` after
    every decode step. ``select`` is called per layer before attention when
    ``query_aware`` is true.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    #: True when the policy may move audio KV back from CPU to GPU.
    recallable: ClassVar[bool] = False
    #: True when ``decode_step`` reads ``StepView.audio_attention`` (costs the engine a buffer).
    needs_step_attention: ClassVar[bool] = False
    #: True when the policy implements the per-layer ``select`` hook.
    query_aware: ClassVar[bool] = False
    #: False for policies that keep everything resident and only reduce what attention reads
    #: (Quest): their saving is bandwidth, not capacity.
    saves_capacity: ClassVar[bool] = True
    #: True when ``select_layers`` is implemented (replay's fast path for ``select``).
    selects_all_layers: ClassVar[bool] = False
    #: True when ``select_device`` and ``sync_device_state`` are implemented: live decoding
    #: then selects on the model's device, with no host read per layer.
    selects_on_device: ClassVar[bool] = False

    budget: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 < self.budget <= 1.0):
            raise ValueError(f"{self.name}: budget r_GPU must be in (0, 1], got {self.budget}")

    # ----------------------------------------------------------------------------- protocol
    @abc.abstractmethod
    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        """Return the initial tiers, shape (L, H_kv, T_a), dtype uint8."""

    def decode_step(self, view: StepView) -> np.ndarray | None:
        """Update tiers after a decode step; return the new tiers or None if unchanged."""
        return None

    def select(self, view: QueryView) -> np.ndarray | None:
        """Per-layer query-aware hook. Return a bool mask (H_kv, T_a) of the audio positions
        attention reads at this layer and step (must be GPU-resident after the call), or None
        to read every GPU-resident position. May update the policy's own tiers of that layer."""
        return None

    def select_layers(self, view: StepQueryView) -> np.ndarray | None:
        """Every layer's ``select`` of one step at once (``selects_all_layers``): the same
        reads, stacked (L, H_kv, T_a) bool, and the same tier updates as calling ``select`` for
        layer 0, 1, ..., L-1 with these queries, or None to read every GPU-resident position.

        Only for policies whose selection at a layer depends on nothing but that layer (its
        query, keys and own state). An open-loop driver (the replay engine) knows every
        layer's query before the step and calls this once instead of ``select`` per layer.
        """
        raise NotImplementedError(f"{self.name} does not select all layers at once")

    def step_attention_layers(self) -> list[int] | None:
        """Layers whose ``StepView.audio_attention`` ``decode_step`` reads (asked once, after
        ``prefill``), or None for every layer. A driver may skip computing the others."""
        return None

    def gpu_capacity(self) -> int | None:
        """Upper bound on GPU-resident audio KV tokens at every step, or None for no bound
        beyond L*H_kv*T_a. The engine asserts it at every step."""
        return None

    def current_tiers(self) -> np.ndarray | None:
        """Tiers after the last ``select`` calls (query-aware policies), else None.

        Called once per layer and step: may return the policy's own array, which the caller
        must treat as read-only (the engine copies what it keeps)."""
        return None

    # ----------------------------------------------------------------------------- helpers
    @classmethod
    def hyperparameters(cls) -> dict[str, Any]:
        """Field name -> default, for ``kvsim policies`` and parameter parsing."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "budget" or not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out

    def describe(self) -> str:
        """Short label like ``snapkv(window=32)`` listing non-default hyperparameters."""
        defaults = self.hyperparameters()
        changed = [
            f"{k}={getattr(self, k)}" for k, v in defaults.items() if getattr(self, k) != v
        ]
        return f"{self.name}({','.join(changed)})" if changed else self.name


def full_tiers(ctx: PolicyContext, tier: Tier = Tier.GPU) -> np.ndarray:
    """A tier array with every audio position in ``tier``."""
    return np.full(
        (ctx.heads.n_layers, ctx.heads.n_kv_heads, ctx.n_audio), int(tier), dtype=TIER_DTYPE
    )


def kv_group_sum(q_head_values: np.ndarray, group: int) -> np.ndarray:
    """Sum a q-head axis (axis 0, length H_q) over GQA groups -> length H_kv."""
    h_q = q_head_values.shape[0]
    return q_head_values.reshape(h_q // group, group, *q_head_values.shape[1:]).sum(axis=1)


def topk_mask(scores: np.ndarray, k: np.ndarray | int) -> np.ndarray:
    """Boolean mask of the top-``k`` entries along the last axis (per row ``k`` allowed).

    Ties are broken towards the earlier position (stable), so results are deterministic.
    """
    return topk_from_ranks(descending_ranks(scores), k)


def descending_ranks(scores: np.ndarray) -> np.ndarray:
    """Rank of every entry along the last axis by descending score, ties to the earlier
    position (0 = highest): what :func:`topk_mask` compares with ``k``. Policies that select
    from the same scores at several budgets share these (see :func:`shared`)."""
    scores = np.asarray(scores)
    n = scores.shape[-1]
    order = np.argsort(-scores, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(n)[(None,) * (scores.ndim - 1)], axis=-1)
    return ranks


def topk_from_ranks(ranks: np.ndarray, k: np.ndarray | int) -> np.ndarray:
    """:func:`topk_mask` from precomputed :func:`descending_ranks` (per row ``k`` allowed)."""
    k_arr = np.broadcast_to(np.asarray(k, dtype=np.int64), ranks.shape[:-1])
    return ranks < np.clip(k_arr, 0, ranks.shape[-1])[..., None]
