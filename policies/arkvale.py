"""ArkVale (Chen et al., NeurIPS 2024): recallable page eviction with bounding-box digests.

ArkVale (method: page digests and recall; defaults from the authors' code,
``source/arkvale/infer_state.py``) manages the KV cache in pages of ``page_size`` tokens (32).
The GPU holds a fixed budget of pages; every page is backed up to host memory, so an evicted
page can be recalled.
Each page has a digest, a bounding box of its keys: centre ``c = (max + min) / 2`` and
per-channel radius ``d = mean_j |k_j - c|`` (the reference implementation's cuboid). At every
decode step and layer the current query scores every page (resident or not) by the upper
bound of ``q . k`` over its box, ``sum_i max(q_i (c_i + d_i), q_i (c_i - d_i))``; the top-k
pages must be resident, so missing ones are recalled from the CPU mirror, replacing the
lowest-scored resident pages outside the top-k, which go back to CPU. Sink pages (start) and
window pages (end) are always resident. A budget that holds no page raises
:class:`~kvsim.policies.base.PolicyNotApplicable` (the input is refused, never run empty).

Reading under the audio-only scope (WnW §3.3, App. F: "page size 32, top-k recall budget
proportional to the target audio KV retention r_GPU, CPU mirror of all evicted pages"):

* pages tile the audio span of each (layer, KV-head); the page budget ``P`` (resident pages,
  sink and window pages included: sink first, then window, while they fit) is the number of
  pages that fit in the token budget ``floor(r * T_a)`` (``budget_unit="tokens"``, default;
  free slots are sized as full pages so any choice fits) or ``floor(r * n_pages)``
  (``budget_unit="pages"``; with a partial last page it can undershoot r by up to a page, e.g.
  0.147 instead of 0.2 on a 750-token trace);
* every non-resident page is on CPU: r_GPU+CPU = 1 (full mirror);
* top-k: ``k = floor(topk_fraction * P) - n_forced`` (the reference code's default top-k is
  half the page budget minus sink and window pages), at least 1 when a free slot exists;
  ``topk_fraction = 1`` keeps exactly the top pages resident;
* the prompt prefix and generated tokens, ArkVale's own sinks and window, are always resident
  here, so the audio gets one sink page and one window page by default;
* prefill: the reference code picks the pages to keep at prefill with the prompt queries; this
  policy ranks pages by the largest attention the last prompt query pays to any of their
  tokens (the exact quantity the box bound approximates);
* GQA: a KV-head's page score combines the bounds of its q-heads (``group_reduce``);
* attention reads every resident page (``sparse_read = False``, the reference default) or
  only sink + top-k + window pages (``sparse_read = True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsim.policies._pages import (
    PageBoxes,
    PageDigests,
    bounding_box_digest,
    expand_pages,
    n_pages,
    page_sizes,
    page_starts,
    recall_plan,
    reduce_group,
)
from kvsim.policies._params import (
    GROUP_REDUCES,
    require_bool,
    require_choice,
    require_int,
    require_real,
)
from kvsim.policies.base import (
    TIER_CPU,
    TIER_GPU,
    Policy,
    PolicyContext,
    PolicyNotApplicable,
    PrefillView,
    QueryView,
    StepQueryView,
    shared,
    topk_mask,
)
from kvsim.policies.registry import register

if TYPE_CHECKING:
    import torch

    from kvsim.policies._pages_torch import DevicePages

#: tier of a page by residency: index False -> CPU (the mirror), True -> GPU
_TIER_OF_RESIDENT = np.array([TIER_CPU, TIER_GPU], dtype=np.uint8)


def last_query_page_max(audio_attention: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(H_q, n_pages) float64: the largest attention the last window query of every q-head pays
    to a token of each page, from one layer's (H_q, W, T_a) window attention over the audio
    (pages starting at ``starts``). A maximum is exact, so it is the same whether taken per
    layer or over a stack of layers."""
    return np.maximum.reduceat(audio_attention[:, -1, :].astype(np.float64), starts, axis=-1)


@register
@dataclass
class ArkVale(Policy):
    """Query-aware page recall from a full CPU mirror under a GPU page budget.

    Parameters
    ----------
    page_size : int
        Tokens per page (WnW App. F: "Page size 32", ArkVale's default).
    n_sink_pages : int
        Pages at the start of the audio that are always resident (1: the reference code keeps
        sink and window pages; under the audio-only scope one page each, see above).
    n_window_pages : int
        Pages at the end of the audio that are always resident (1, as ``n_sink_pages``).
    topk_fraction : float
        Top-k pages that must be resident each step, as a fraction of the page budget
        (before subtracting sink and window pages); 0.5 as in the reference code.
    group_reduce : str
        How the q-heads of a GQA group combine their page bounds: ``max``, ``mean``, ``sum``.
    sparse_read : bool
        Attention reads only sink + top-k + window pages instead of every resident page.
    budget_unit : str
        ``"tokens"`` (default): as many pages as fit in ``floor(r * T_a)`` tokens per head, so
        the measured r_GPU never exceeds the target and sits within one page of it;
        ``"pages"``: ``floor(r * n_pages)`` pages, the partial last page counted as one.
    share_heads : bool
        One page selection per layer for all its KV-heads, scores combined over every q-head
        of the layer (the reference code's default, where a page holds every head's KV);
        False (default) selects per KV-head from its GQA group.
    """

    name = "arkvale"
    paper = (
        "Chen et al., ArkVale: Efficient Generative LLM Inference with Recallable Key-Value "
        "Eviction, NeurIPS 2024"
    )
    recallable = True
    query_aware = True
    selects_all_layers = True
    selects_on_device = True

    page_size: int = 32
    n_sink_pages: int = 1
    n_window_pages: int = 1
    topk_fraction: float = 0.5
    group_reduce: str = "max"
    sparse_read: bool = False
    budget_unit: str = "tokens"
    share_heads: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "page_size", self.page_size, lo=1)
        require_int(n, "n_sink_pages", self.n_sink_pages, lo=0)
        require_int(n, "n_window_pages", self.n_window_pages, lo=0)
        require_real(n, "topk_fraction", self.topk_fraction, lo=0, hi=1, lo_open=True)
        require_choice(n, "group_reduce", self.group_reduce, GROUP_REDUCES)
        require_bool(n, "sparse_read", self.sparse_read)
        require_choice(n, "budget_unit", self.budget_unit, ("tokens", "pages"))
        require_bool(n, "share_heads", self.share_heads)

    # ----------------------------------------------------------------------------- prefill
    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        t_a, h = ctx.n_audio, ctx.heads
        self._n_audio = t_a
        npg = n_pages(t_a, self.page_size)
        #: resident pages per (layer, KV-head), at every step
        self.page_budget, self._forced = self._page_plan(t_a)
        if self.page_budget == 0:
            raise PolicyNotApplicable(f"arkvale: {self._no_page(t_a, npg)}: no page fits; lower "
                                      f"page_size (now {self.page_size}) or raise r")
        n_free = self.page_budget - int(self._forced.sum())
        k = int(np.floor(self.topk_fraction * self.page_budget + 1e-9)) - int(self._forced.sum())
        #: top-k pages that must be resident after each step's selection
        self.topk = int(np.clip(k, min(1, n_free), n_free))

        def prefill_scores() -> np.ndarray:  # (L, H_kv, P), the same for every budget
            if view.n_window == 0:
                return np.zeros((h.n_layers, h.n_kv_heads, npg))
            starts = page_starts(t_a, self.page_size)
            per_q = np.empty((h.n_layers, h.n_q_heads, npg))  # a layer at a time: no (L, H_q, T_a)
            for layer in range(h.n_layers):
                per_q[layer] = last_query_page_max(view.audio_attention(layer), starts)
            return self._combine(per_q.reshape(h.n_layers, h.n_kv_heads, h.group, npg))

        scores = shared(view, ("arkvale-prefill", self.page_size, self.group_reduce,
                               self.share_heads), prefill_scores)
        top = topk_mask(np.where(self._forced, -np.inf, scores), n_free)
        self._resident = self._forced | top  # (L, H_kv, P)
        self._tiers = self._tiers_from_pages(self._resident)
        #: per layer, the GPU-resident positions (H_kv, T_a); replaced, never mutated, so a
        #: mask handed out by ``select`` stays valid
        self._on_gpu = [self._read_only(expand_pages(r, t_a, self.page_size))
                        for r in self._resident]
        sizes = page_sizes(t_a, self.page_size)
        free_sizes = np.sort(sizes[~self._forced])[::-1]
        per_head = int(sizes[self._forced].sum() + free_sizes[:n_free].sum())
        self._capacity = per_head * h.n_heads_total
        self._digests = PageDigests(bounding_box_digest, self.page_size)
        self._device: DevicePages | None = None  # what select_device keeps on a device
        return self._tiers.copy()

    def _no_page(self, t_a: int, npg: int) -> str:
        """The page budget's arithmetic, for the message of a budget of 0 pages."""
        if self.budget_unit == "pages":
            return f"floor({self.budget:g} × {npg} pages) = 0 pages"
        return f"r={self.budget:g} of {t_a} audio tokens is {int(np.floor(self.budget * t_a + 1e-9))} tokens"

    def _page_plan(self, t_a: int) -> tuple[int, np.ndarray]:
        """Page budget and always-resident (sink, window) pages of one (layer, KV-head)."""
        npg = n_pages(t_a, self.page_size)
        sizes = page_sizes(t_a, self.page_size)
        forced = np.zeros(npg, dtype=bool)
        sink = list(range(min(self.n_sink_pages, npg)))
        window = [p for p in range(npg - 1, -1, -1) if p not in sink][: self.n_window_pages]
        if self.budget_unit == "pages":
            budget = int(np.floor(self.budget * npg + 1e-9))
            for p in (sink + window)[:budget]:
                forced[p] = True
            return budget, forced
        tokens = int(np.floor(self.budget * t_a + 1e-9))
        used = 0
        for group in (sink, window):
            for p in group:
                if used + sizes[p] > tokens:
                    break
                forced[p] = True
                used += int(sizes[p])
        # free slots are sized as full pages, so any choice of pages fits the token budget;
        # there are that many free pages: their sizes sum to T_a - used >= tokens - used
        n_free = (tokens - used) // self.page_size
        return int(forced.sum()) + n_free, forced

    # ----------------------------------------------------------------------------- decode
    def digest(self, layer: int, keys: np.ndarray) -> PageBoxes:
        """Bounding boxes ``c -/+ d`` of the pages of ``layer``, computed once."""
        return self._digests.of(layer, keys)

    def page_scores(self, view: QueryView) -> np.ndarray:
        """Upper bound of ``q . k`` over every page box for the current query, (H_kv, n_pages)."""
        def compute() -> np.ndarray:
            boxes = self.digest(view.layer, view.audio_keys())
            return self._combine(boxes.upper_bound(view.query()))

        # the bound does not depend on the budget: computed once per step and layer for all
        # ArkVale runs with the same page geometry and reduction
        return shared(view, self._geometry(), compute)

    def _geometry(self) -> tuple:
        return ("arkvale", self.page_size, self.group_reduce, self.share_heads)

    def _combine(self, per_q: np.ndarray) -> np.ndarray:
        """(..., H_kv, g, P) per-q-head page scores -> (..., H_kv, P), shared by the layer's
        KV-heads if asked."""
        if self.share_heads:
            *lead, h_kv, g, n = per_q.shape
            layer = reduce_group(per_q.reshape(*lead, 1, h_kv * g, n), self.group_reduce)
            return np.broadcast_to(layer, (*lead, h_kv, n))
        return reduce_group(per_q, self.group_reduce)

    def select(self, view: QueryView) -> np.ndarray | None:
        """Recall the top-k pages of this query; evict the lowest-scored others to make room.

        The page bounds and their ascending order do not depend on the budget: computed once
        per step and layer for every ArkVale run (:func:`shared`); the eviction is a cumulative
        count along that order (:func:`lowest_among`), equal to the direct ``topk_mask``
        selection (``tests/test_policy_pages_fastpath.py`` compares both with the direct code).
        """
        layer = view.layer
        geometry = self._geometry()
        scores = self.page_scores(view)

        def ascending() -> tuple[np.ndarray, np.ndarray]:
            order = np.argsort(scores, axis=-1, kind="stable")
            return order, np.argsort(order, axis=-1)  # the order and its inverse

        must, new = recall_plan(self._resident[layer], self._forced, scores, self.topk,
                                lambda: shared(view, (*geometry, "ascending"), ascending))
        if new is not None:
            self._resident[layer] = new
            on_gpu = expand_pages(new, self._n_audio, self.page_size)
            np.take(_TIER_OF_RESIDENT, on_gpu.view(np.uint8), out=self._tiers[layer])
            self._on_gpu[layer] = self._read_only(on_gpu)
        if self.sparse_read:
            return expand_pages(must, self._n_audio, self.page_size)
        return self._on_gpu[layer]

    def select_layers(self, view: StepQueryView) -> np.ndarray | None:
        """:meth:`select` of every layer of the step at once (replay): a layer's recall and
        eviction depend only on its query, keys and resident pages, so the same computation
        runs on (L, H_kv, n_pages) arrays. Same reads and tiers as ``select`` layer by layer
        (``tests/test_policy_pages_fastpath.py``)."""
        geometry = self._geometry()

        def scores() -> np.ndarray:  # (L, H_kv, P)
            stacked = self._digests.stacked(self._resident.shape[0], view.audio_keys)
            return self._combine(stacked.upper_bound(view.queries()))

        def ascending() -> tuple[np.ndarray, np.ndarray]:
            order = np.argsort(shared(view, (*geometry, "all"), scores), axis=-1, kind="stable")
            return order, np.argsort(order, axis=-1)

        all_scores = shared(view, (*geometry, "all"), scores)
        must, new = recall_plan(self._resident, self._forced, all_scores, self.topk,
                                lambda: shared(view, (*geometry, "all-ascending"), ascending))
        if new is not None:
            self._adopt_resident(new)
        if self.sparse_read:
            return expand_pages(must, self._n_audio, self.page_size)
        return self._tiers == TIER_GPU

    def _adopt_resident(self, new: np.ndarray) -> None:
        """Make ``new`` (L, H_kv, P) the resident pages: the tiers and GPU masks of the
        layers where they changed follow."""
        changed = np.flatnonzero((new != self._resident).any(axis=(1, 2)))
        on_gpu = expand_pages(new[changed], self._n_audio, self.page_size)
        self._tiers[changed] = _TIER_OF_RESIDENT[on_gpu.view(np.uint8)]
        on_gpu.flags.writeable = False
        for j, layer in enumerate(changed):
            self._on_gpu[layer] = on_gpu[j]
        self._resident = new

    # ----------------------------------------------------------------------------- on device
    def select_device(self, layer: int, query: torch.Tensor, audio_keys: np.ndarray) -> torch.Tensor:
        """:meth:`select` on the query's device (live decoding): the page bounds, the recall
        plan and the pages' expansion to positions run as tensor operations there
        (:mod:`kvsim.policies._pages_torch`), with no read back to the host; the resident pages
        of every layer stay on the device until :meth:`sync_device_state` (once per step).

        Returns the (H_kv, T_a) bool positions attention reads, on the query's device.
        """
        from kvsim.policies import _pages_torch as pt

        if self._device is None or self._device.resident.device != query.device:
            self._device = pt.DevicePages(self._resident, self._forced, self.page_size,
                                          query.device)
        state = self._device
        if layer not in state.boxes:  # computed on the host once, kept on the device only
            digest = self._digests.computed(layer, audio_keys)
            state.boxes[layer] = pt.DevicePageBoxes(digest._mid_t, digest._half_t, query.device)
        per_q = state.boxes[layer].upper_bound(query)  # (H_kv, g, P)
        if self.share_heads:
            h_kv, g, n = per_q.shape
            scores = pt.reduce_group(per_q.reshape(1, h_kv * g, n), self.group_reduce).expand(h_kv, n)
        else:
            scores = pt.reduce_group(per_q, self.group_reduce)
        must, new = pt.recall_plan(state.resident[layer], state.forced, scores, self.topk)
        state.resident[layer] = new
        return state.positions(must if self.sparse_read else new, self._n_audio)

    def sync_device_state(self) -> None:
        """Bring the resident pages chosen on the device back to the policy's tiers (one
        transfer of (L, H_kv, P) bools)."""
        if self._device is not None:  # a copy: on the CPU, .numpy() would share the tensor
            self._adopt_resident(self._device.resident.cpu().numpy().copy())

    @staticmethod
    def _read_only(mask: np.ndarray) -> np.ndarray:
        mask = np.ascontiguousarray(mask)
        mask.flags.writeable = False
        return mask

    def current_tiers(self) -> np.ndarray | None:
        return self._tiers  # read-only for the caller (protocol); no copy per layer and step

    def gpu_capacity(self) -> int | None:
        return self._capacity

    def _tiers_from_pages(self, resident: np.ndarray) -> np.ndarray:
        on_gpu = expand_pages(resident, self._n_audio, self.page_size)
        return _TIER_OF_RESIDENT[on_gpu.view(np.uint8)]
