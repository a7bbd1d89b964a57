"""Quest (Tang et al., ICML 2024): query-aware page selection, every KV stays resident.

Quest (method section "query-aware sparsity", Fig. 5) keeps the whole KV cache in GPU memory
and, at every decode step and layer, reads only the pages that may matter to the *current*
query. Each page of ``page_size`` tokens (16 in the paper) has a digest, the channel-wise min
and max of its keys; the criticality of a page for query ``q`` is the upper bound of ``q . k``
over that box, ``sum_i max(q_i * max_i, q_i * min_i)``, and attention reads the top-K pages.

Under the audio-only scope (WnW §3.3) the pages tile the audio span and the page budget is
``K = floor(r * n_pages)`` per (layer, KV-head); the text and generated tokens are always read.
``K = 0`` raises :class:`~kvsim.policies.base.PolicyNotApplicable` (never read nothing).
Quest saves **bandwidth, not capacity**: its tiers stay all-GPU, so its measured r_GPU is 1.0
while the fraction of audio KV attention reads (``read_audio_tokens`` of the step log) is
about ``r``. GQA: Quest is defined per attention head; a KV-head reads a page when the group
of q-heads sharing it ranks it top (bounds aggregated over the group, ``group_reduce``).
Quest leaves the first two layers dense in its experiments; ``dense_layers`` reproduces that
(default 0, so that every policy here compresses every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.policies._pages import (
    PageBoxes,
    PageDigests,
    minmax_digest,
    n_pages,
    reduce_group,
    top_page_reads,
)
from kvsim.policies._params import GROUP_REDUCES, require_choice, require_int
from kvsim.policies.base import (
    Policy,
    PolicyContext,
    PolicyNotApplicable,
    PrefillView,
    QueryView,
    StepQueryView,
    full_tiers,
    shared,
)
from kvsim.policies.registry import register


@register
@dataclass
class Quest(Policy):
    """Per-step, per-layer top-K pages by the min/max key bound; all KV stays on GPU.

    Parameters
    ----------
    page_size : int
        Tokens per page (Quest: 16-token pages, its default).
    group_reduce : str
        How the per-q-head bounds of a GQA group are combined: ``max`` (default), ``mean``
        or ``sum``.
    dense_layers : int
        The first ``dense_layers`` layers read every page (Quest's experiments use 2; kvsim
        defaults to 0 deliberately, so that every policy compresses every layer).
    """

    name = "quest"
    paper = (
        "Tang et al., Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, "
        "ICML 2024"
    )
    query_aware = True
    saves_capacity = False
    selects_all_layers = True

    page_size: int = 16
    group_reduce: str = "max"
    dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.name
        require_int(n, "page_size", self.page_size, lo=1)
        require_choice(n, "group_reduce", self.group_reduce, GROUP_REDUCES)
        require_int(n, "dense_layers", self.dense_layers, lo=0)

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self._n_audio = ctx.n_audio
        self._n_pages = n_pages(ctx.n_audio, self.page_size)
        #: pages read per (layer, KV-head) and step
        self.page_budget = int(np.floor(self.budget * self._n_pages + 1e-9))
        if self.page_budget == 0:
            raise PolicyNotApplicable(
                f"quest: floor({self.budget:g} × {self._n_pages} pages) = 0 pages to read of "
                f"{ctx.n_audio} audio tokens; lower page_size (now {self.page_size}) or raise r")
        self._digests = PageDigests(minmax_digest, self.page_size)
        self._n_layers = ctx.heads.n_layers
        return full_tiers(ctx)

    def digest(self, layer: int, keys: np.ndarray) -> PageBoxes:
        """Min/max page boxes of ``layer``, computed once from its audio keys."""
        return self._digests.of(layer, keys)

    def page_scores(self, view: QueryView) -> np.ndarray:
        """Criticality upper bound of every page for the current query, (H_kv, n_pages)."""
        def compute() -> np.ndarray:
            boxes = self.digest(view.layer, view.audio_keys())
            return reduce_group(boxes.upper_bound(view.query()), self.group_reduce)

        # independent of the budget: computed once per step and layer for all Quest runs
        return shared(view, ("quest", self.page_size, self.group_reduce), compute)

    def select(self, view: QueryView) -> np.ndarray | None:
        if view.layer < self.dense_layers:
            return None
        return top_page_reads(self.page_scores(view), self.page_budget, self._n_audio,
                              self.page_size)

    def select_layers(self, view: StepQueryView) -> np.ndarray | None:
        """:meth:`select` of every layer of the step at once (replay): Quest's choice at a
        layer depends only on that layer's query and keys, so the bounds of all layers are one
        batched product and the top-K one partition of their rows. The bounds do not depend on
        the budget: computed once per step for every Quest run. Dense layers read every
        position (all of Quest's audio is on GPU), as ``select`` returning None does."""
        def scores() -> np.ndarray:  # (L, H_kv, P)
            stacked = self._digests.stacked(self._n_layers, view.audio_keys)
            return reduce_group(stacked.upper_bound(view.queries()), self.group_reduce)

        key = ("quest-all", self.page_size, self.group_reduce)
        reads = top_page_reads(shared(view, key, scores), self.page_budget, self._n_audio,
                               self.page_size)
        reads[: self.dense_layers] = True
        return reads
