"""ArkVale's page selection (ArkVale §4, recall and eviction) in torch, on the model's device.

The same computation as :func:`kvsim.policies._pages.recall_plan` and
:meth:`kvsim.policies._pages.PageBoxes.upper_bound`, written with tensor operations only: no
value is read back to the host, so on CUDA a decode step's selections run without a host
synchronisation per layer (the paper's system selects on the GPU). The plan is computed
whether or not a page is missing (a test for "nothing missing" would be a host read); when
nothing is missing it evicts nothing, which is the NumPy plan's "residents stay".

Given the same scores, the pages are the NumPy plan's (``tests/test_policy_pages_torch.py``):
the top-k pages of a row are a set, and the evictions follow the scores' stable ascending
order. The scores themselves are float32 products on another kernel, equal within rounding.
"""

from __future__ import annotations

import numpy as np
import torch


class DevicePageBoxes:
    """One layer's page boxes (centre and half-width, as :class:`PageBoxes` keeps them) as
    float32 tensors on a device.

    Parameters
    ----------
    mid_t, half_t : (H_kv, D, P) float32 arrays
        ``PageBoxes._mid_t`` and ``PageBoxes._half_t``.
    device : torch.device
    """

    def __init__(self, mid_t: np.ndarray, half_t: np.ndarray, device: torch.device) -> None:
        self.mid_t = torch.as_tensor(mid_t, device=device)
        self.half_t = torch.as_tensor(half_t, device=device)

    def upper_bound(self, query: torch.Tensor) -> torch.Tensor:
        """(H_kv, g, P) largest ``q . k`` over every page box for the (H_q, D) query:
        ``q m + |q| w`` in float32 (:meth:`PageBoxes.upper_bound`)."""
        h_kv, d, _ = self.mid_t.shape
        q = query.to(torch.float32).reshape(h_kv, -1, d)
        return torch.matmul(q, self.mid_t) + torch.matmul(q.abs(), self.half_t)


class DevicePages:
    """The resident pages of every layer, and what expands pages to positions, on a device.

    Parameters
    ----------
    resident : (L, H_kv, P) bool array
        The resident pages to start from (copied).
    forced : (P,) bool array
        The pages that are always resident (sink, window).
    page_size : int
    device : torch.device
    """

    def __init__(self, resident: np.ndarray, forced: np.ndarray, page_size: int,
                 device: torch.device) -> None:
        n_audio = page_size * resident.shape[-1]
        self.resident = torch.tensor(resident, device=device)
        self.forced = torch.as_tensor(forced, device=device)
        self.page_of_position = torch.arange(n_audio, device=device) // page_size
        self.boxes: dict[int, DevicePageBoxes] = {}  #: per layer, its page boxes

    def positions(self, pages: torch.Tensor, n_audio: int) -> torch.Tensor:
        """(..., T_a) per-position array of a (..., P) per-page one (:func:`expand_pages`)."""
        return pages.index_select(-1, self.page_of_position[:n_audio])


def reduce_group(values: torch.Tensor, how: str) -> torch.Tensor:
    """(..., H_kv, g, P) -> (..., H_kv, P) over the GQA group (:func:`_pages.reduce_group`)."""
    if how == "max":
        return values.amax(dim=-2)
    if how == "mean":
        return values.mean(dim=-2)
    if how == "sum":
        return values.sum(dim=-2)
    raise ValueError(f"group_reduce must be 'max', 'mean' or 'sum', got {how!r}")


def top_pages(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the ``k`` highest scores of every row (:func:`_pages.top_pages`)."""
    n = scores.shape[-1]
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if k >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    idx = torch.topk(scores, k, dim=-1, sorted=False).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def lowest_among(candidates: torch.Tensor, k: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The ``k[row]`` lowest-scored candidate pages of every row, ties to the earlier page
    (:func:`_pages.lowest_among`): the candidates taken in the scores' stable ascending order,
    the first ``k`` of each row."""
    order = torch.argsort(scores, dim=-1, stable=True)
    seen = torch.cumsum(candidates.gather(-1, order).to(torch.int32), dim=-1)
    seen_at = torch.empty_like(seen).scatter_(-1, order, seen)  # back in page order
    return candidates & (seen_at <= k.unsqueeze(-1))


def recall_plan(resident: torch.Tensor, forced: torch.Tensor, scores: torch.Tensor,
                topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ArkVale's recall and eviction for one query (:func:`_pages.recall_plan`): ``must`` = the
    ``forced`` pages and the ``topk`` best-scored others; every ``must`` page not resident is
    recalled and as many of the lowest-scored resident pages outside ``must`` are evicted.
    Returns ``must`` and the new resident pages (the old ones when nothing is missing)."""
    masked = scores.masked_fill(forced, float("-inf"))
    must = forced | top_pages(masked, topk)
    missing = must & ~resident
    lowest = lowest_among(resident & ~must, missing.sum(dim=-1, dtype=torch.int32), scores)
    return must, (resident & ~lowest) | missing
