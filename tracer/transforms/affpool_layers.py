"""AffPool inside the decoder (WnW App. F): affinity pooling of the audio hidden states at the
output of each of the first layers, so that every later layer holds fewer audio KV entries.

WnW App. F: "Deep pooling with window size 3 is applied to the first 27 layers of
Voxtral-mini-3b, and input pooling with window size 1 is applied to the last 3 layers. The
retention rate is controlled by calibrating the affinity threshold τ on a held-out subset".
kvsim's reading:

* at the output of pooling layer ``l`` (the first ``n_pool_layers``, default all but the last
  3 as in App. F: 27 of Voxtral-mini's 30) the surviving audio tokens are scanned left to
  right as in the input variant (:func:`kvsim.tracer.transforms.affpool.groups_for`: a group
  grows while the cosine affinity of consecutive hidden states is ``>= τ`` and it has fewer
  than ``window`` tokens); each group becomes one token, the mean of its members' hidden
  states weighted by the original tokens each stands for; the last layers (window 1) pool
  nothing. Layer ``l`` itself keeps its KV; layers ``l + 1, ...`` hold the pooled sequence;
* a merged token keeps the position (RoPE) of its first member and the other members leave
  the sequence. The prefill computes this on the full-length sequence with the members
  masked out of every later layer's attention (they are never read, exactly as if removed);
  after prefill their KV is removed from each layer's cache, so decoding reads physically
  shorter caches;
* retention is WnW §3.3's "remaining audio-token ratio" taken over the KV, i.e. §3.4's
  N^audio / (L·H_kv·T_a): the mean over layers of each layer's audio KV length over T_a;
* τ is one threshold for every layer, set on held-out prompts by bisection
  (:func:`calibrate_layer_threshold`) so that their mean retention meets the target.

With no merge (τ above every affinity) nothing is changed and decoding is token-identical to
the full cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsim.tracer.transforms.affpool import adjacent_affinity, groups_for

#: WnW App. F: the last 3 layers of Voxtral-mini-3b pool with window 1 (not at all)
UNPOOLED_LAST_LAYERS = 3


@dataclass(frozen=True)
class LayerPoolConfig:
    """In-layer AffPool settings (WnW App. F).

    Parameters
    ----------
    threshold : float
        Affinity threshold τ (cosine similarity; above 1 nothing merges).
    window : int
        Largest group per layer (App. F "deep pooling with window size 3").
    n_pool_layers : int or None
        Layers whose output is pooled, from the first; None = all but the last
        :data:`UNPOOLED_LAST_LAYERS` (27 of Voxtral-mini-3b's 30).
    """

    threshold: float
    window: int = 3
    n_pool_layers: int | None = None

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"affpool_layers: window must be >= 2, got {self.window}")
        if self.n_pool_layers is not None and self.n_pool_layers < 0:
            raise ValueError(f"affpool_layers: n_pool_layers must be >= 0, got {self.n_pool_layers}")

    def pool_layers(self, n_layers: int) -> int:
        """Number of pooling layers of a model with ``n_layers`` decoder layers."""
        n = n_layers - UNPOOLED_LAST_LAYERS if self.n_pool_layers is None else self.n_pool_layers
        return max(0, min(n, n_layers))


class LayerAffPool:
    """The state of one pooled prefill: which audio tokens every layer still holds.

    ``alive[l]`` (bool, T_a) marks the audio tokens whose KV layer ``l`` holds; ``size`` counts
    the original tokens each surviving token stands for.
    """

    def __init__(self, cfg: LayerPoolConfig, n_layers: int, audio_positions: np.ndarray) -> None:
        a = np.asarray(audio_positions, dtype=np.int64)
        if len(a) and a[-1] - a[0] + 1 != len(a):
            raise ValueError("affpool_layers: the audio span must be contiguous")
        self.cfg = cfg
        self.n_layers = n_layers
        self.n_pool = cfg.pool_layers(n_layers)
        self.a0 = int(a[0]) if len(a) else 0
        self.n_audio = len(a)
        self.alive = [np.ones(self.n_audio, dtype=bool) for _ in range(n_layers)]
        self.size = np.ones(self.n_audio, dtype=np.int64)

    def audio_kv_lengths(self) -> list[int]:
        """Audio KV entries of every layer."""
        return [int(m.sum()) for m in self.alive]

    @property
    def retention(self) -> float:
        """Mean over layers of audio KV length / T_a (WnW §3.4's ratio)."""
        return float(np.mean(self.audio_kv_lengths()) / max(self.n_audio, 1))

    def pool(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Pool the output ``hidden`` (1, N, d) of ``layer``; updates ``alive`` of the later
        layers and returns the new hidden states (``hidden`` itself when nothing merged)."""
        alive = self.alive[layer]
        surv = np.flatnonzero(alive)
        if len(surv) < 2:
            return hidden
        rows = hidden[0, self.a0 + surv]
        groups = [(a, b) for a, b in groups_for(adjacent_affinity(rows), self.cfg.threshold,
                                                 self.cfg.window) if b - a > 1]
        if not groups:
            return hidden
        out = hidden.clone()
        new_alive = alive.copy()
        for a, b in groups:
            idx = surv[a:b]
            w = torch.as_tensor(self.size[idx], dtype=torch.float32, device=hidden.device)
            mean = (w[:, None] * rows[a:b].float()).sum(0) / w.sum()
            out[0, self.a0 + idx[0]] = mean.to(hidden.dtype)
            self.size[idx[0]] = self.size[idx].sum()
            new_alive[idx[1:]] = False
        for later in range(layer + 1, self.n_layers):
            self.alive[later] = new_alive
        return out

    def attention_mask(self, layer: int, n: int, device: torch.device) -> torch.Tensor | None:
        """Prefill mask (1, 1, n, n) of ``layer``: causal, minus the pooled-away audio tokens;
        None when the layer holds every token (the model's own mask is then kept)."""
        alive = self.alive[layer]
        if alive.all():
            return None
        keep = torch.ones(n, dtype=torch.bool, device=device)
        keep[self.a0:self.a0 + self.n_audio] = torch.as_tensor(alive, device=device)
        causal = torch.ones((n, n), dtype=torch.bool, device=device).tril()
        return (causal & keep[None, :])[None, None]

    def shrink_cache(self, cache: Any) -> None:
        """Remove the pooled-away audio KV from every layer of a filled prefill cache."""
        for layer, alive in enumerate(self.alive):
            if alive.all():
                continue
            cl = cache.layers[layer]
            n = cl.keys.shape[-2]
            keep = np.ones(n, dtype=bool)
            keep[self.a0:self.a0 + self.n_audio] = alive
            idx = torch.as_tensor(np.flatnonzero(keep), device=cl.keys.device)
            cl.keys = cl.keys.index_select(2, idx)
            cl.values = cl.values.index_select(2, idx)


def decoder_layers(model: torch.nn.Module, n_layers: int, attn: str) -> torch.nn.ModuleList:
    """The text decoder's layers: the ModuleList of ``n_layers`` blocks whose attention runs
    ``attn`` (the text config's attention implementation, e.g. live mode's, which is set on
    the text decoder only, not on an audio encoder)."""
    for m in model.modules():
        if _is_live_decoder(m, n_layers, attn):
            return m
    raise ValueError(f"affpool_layers: no text decoder with {n_layers} live-attention layers found")


def _is_live_decoder(m: torch.nn.Module, n_layers: int, attn: str) -> bool:
    if not (isinstance(m, torch.nn.ModuleList) and len(m) == n_layers):
        return False
    configs = [getattr(getattr(x, "self_attn", None), "config", None) for x in m]
    return all(c is not None and c._attn_implementation == attn for c in configs)


@contextmanager
def pooling_hooks(layers: Sequence[torch.nn.Module], pool: LayerAffPool) -> Iterator[LayerAffPool]:
    """Install the pooling (output of the first ``pool.n_pool`` layers) and the masks (input
    of every layer) for one prefill forward."""

    def pre(layer: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            mask = pool.attention_mask(layer, hidden.shape[1], hidden.device)
            if mask is None:
                return None
            return args, {**kwargs, "attention_mask": mask}
        return hook

    def post(layer: int):
        def hook(module, args, output):
            if isinstance(output, tuple):
                return (pool.pool(output[0], layer), *output[1:])
            return pool.pool(output, layer)
        return hook

    handles = [layer_mod.register_forward_pre_hook(pre(i), with_kwargs=True)
               for i, layer_mod in enumerate(layers)]
    handles += [layers[i].register_forward_hook(post(i)) for i in range(pool.n_pool)]
    try:
        yield pool
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def measure_retention(lm: Any, prompts: Sequence[Any], cfg: LayerPoolConfig) -> float:
    """Mean in-layer AffPool retention of ``prompts`` (LivePrompts of ``lm``) under ``cfg``: one
    prefill forward each, no cache kept."""
    n_layers = lm.layout.n_layers
    layers = decoder_layers(lm.model, n_layers, lm.text_config._attn_implementation)
    values = []
    for prompt in prompts:
        pool = LayerAffPool(cfg, n_layers, prompt.audio_positions)
        with pooling_hooks(layers, pool):
            lm.model(**prompt.prefill_inputs(), use_cache=False, logits_to_keep=1)
        values.append(pool.retention)
    return float(np.mean(values))


def calibrate_layer_threshold(lm: Any, prompts: Sequence[Any], retention: float,
                              cfg: LayerPoolConfig | None = None,
                              iters: int = 24) -> tuple[float, float]:
    """WnW App. F: the affinity threshold τ whose mean retention over the held-out ``prompts``
    is closest to ``retention``, by bisection (fewer tokens kept as τ falls). Returns
    ``(τ, measured mean retention)``; a target below what merging everything reaches is an
    error naming the reachable floor."""
    import dataclasses

    base = cfg or LayerPoolConfig(threshold=1.0)

    def measured(t: float) -> float:
        return measure_retention(lm, prompts, dataclasses.replace(base, threshold=t))

    lo, hi = -1.0 - 1e-6, 1.0 + 1e-6  # lo merges every allowed group, hi none
    floor = measured(lo)
    if not (floor - 1e-9 <= retention <= 1.0):
        raise ValueError(f"affpool_layers: retention {retention} is outside [{floor:.3f}, 1] "
                         f"for window {base.window} and {base.pool_layers(lm.layout.n_layers)} "
                         "pooling layers")
    best = min((hi, 1.0), (lo, floor), key=lambda tr: abs(tr[1] - retention))
    for _ in range(iters):
        mid = (lo + hi) / 2
        r = measured(mid)
        if abs(r - retention) < abs(best[1] - retention):
            best = (mid, r)
        if r >= retention:
            hi = mid
        else:
            lo = mid
    return best
