"""Page layout, page digests and query-aware page bounds shared by Quest and ArkVale.

The audio span of every (layer, KV-head) is cut into contiguous pages of ``page_size`` tokens
starting at the first audio position; the last page may be partial. A page digest is an
axis-aligned box ``[lo, hi]`` in key space (one interval per channel):

* Quest (Tang et al. 2024, "query-aware sparsity", Fig. 5): ``lo``/``hi`` are the channel-wise
  minimum and maximum of the page's keys, so the box contains every key of the page;
* ArkVale (Chen et al. 2024, bounding-volume page digests): the box centred on
  ``c = (max + min) / 2`` with per-channel radius ``d = mean_j |k_j - c|`` over the page's keys
  (the reference implementation's cuboid digest); it is tighter than the min/max box and need
  not contain every key.

For a query ``q`` the largest dot product with any point of a box is
``sum_i max(q_i * hi_i, q_i * lo_i) = q+ . hi + q- . lo`` (Quest's upper bound of the attention
logit), computed here for all pages at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache

import numpy as np


def n_pages(n_audio: int, page_size: int) -> int:
    """Number of pages covering ``n_audio`` tokens (last one possibly partial)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    return -(-n_audio // page_size)


def page_starts(n_audio: int, page_size: int) -> np.ndarray:
    """First audio position of every page, shape (n_pages,)."""
    return np.arange(0, n_audio, page_size, dtype=np.int64)


def page_sizes(n_audio: int, page_size: int) -> np.ndarray:
    """Tokens in every page, shape (n_pages,); all ``page_size`` except maybe the last."""
    starts = page_starts(n_audio, page_size)
    return np.minimum(starts + page_size, n_audio) - starts


def page_of_position(n_audio: int, page_size: int) -> np.ndarray:
    """Page index of every audio position, shape (T_a,)."""
    return np.arange(n_audio, dtype=np.int64) // page_size


@lru_cache(maxsize=64)
def _position_pages(n_audio: int, page_size: int) -> np.ndarray:
    """Read-only :func:`page_of_position`, computed once per geometry (hot path)."""
    out = page_of_position(n_audio, page_size)
    out.flags.writeable = False
    return out


def expand_pages(page_mask: np.ndarray, n_audio: int, page_size: int) -> np.ndarray:
    """Turn a per-page array (..., n_pages) into a per-position array (..., T_a)."""
    return np.take(page_mask, _position_pages(n_audio, page_size), axis=-1)


def minmax_digest(keys: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Quest digest: channel-wise (min, max) of each page's keys.

    Parameters
    ----------
    keys : (H_kv, T_a, D) array

    Returns
    -------
    lo, hi : (H_kv, n_pages, D) float32 arrays
    """
    keys = _check_keys(keys)
    starts = page_starts(keys.shape[1], page_size)
    lo = np.minimum.reduceat(keys, starts, axis=1)
    hi = np.maximum.reduceat(keys, starts, axis=1)
    return lo.astype(np.float32), hi.astype(np.float32)


def bounding_box_digest(keys: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """ArkVale cuboid digest: box ``c ± d`` with ``c = (max+min)/2`` and ``d = mean|k - c|``.

    Parameters
    ----------
    keys : (H_kv, T_a, D) array

    Returns
    -------
    lo, hi : (H_kv, n_pages, D) float32 arrays, ``lo = c - d`` and ``hi = c + d``
    """
    keys = _check_keys(keys)
    h_kv, t_a, d = keys.shape
    lo = np.empty((h_kv, n_pages(t_a, page_size), d), dtype=np.float32)
    hi = np.empty_like(lo)
    for head in range(h_kv):  # float64 temporaries of one KV-head at a time, not of the layer
        lo[head : head + 1], hi[head : head + 1] = _head_box(keys[head : head + 1], page_size)
    return lo, hi


def _head_box(keys: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`bounding_box_digest` of one KV-head's keys, shape (1, T_a, D).

    Every page's box depends only on its own keys, and each reduction runs along the token
    axis as it would over every head at once, so the result is the same bit for bit.
    """
    t_a = keys.shape[1]
    starts = page_starts(t_a, page_size)
    lo = np.minimum.reduceat(keys, starts, axis=1).astype(np.float64)
    hi = np.maximum.reduceat(keys, starts, axis=1).astype(np.float64)
    centre = (hi + lo) / 2.0
    dev = np.abs(keys.astype(np.float64) - centre[:, _position_pages(t_a, page_size), :])
    radius = np.add.reduceat(dev, starts, axis=1) / page_sizes(t_a, page_size)[None, :, None]
    return (centre - radius).astype(np.float32), (centre + radius).astype(np.float32)


def box_upper_bound(query: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Largest ``q . k`` over each page box, for every q-head: ``sum_i max(q_i hi_i, q_i lo_i)``.

    Parameters
    ----------
    query : (H_q, D) array, post-RoPE query of the current token
    lo, hi : (H_kv, n_pages, D) arrays with ``lo <= hi``; q-head ``h`` reads KV-head
        ``h // (H_q / H_kv)`` (GQA)

    Returns
    -------
    (H_kv, g, n_pages) float32 array, ``g = H_q / H_kv``
    """
    return PageBoxes(lo, hi).upper_bound(query)


class PageBoxes:
    """Page digests of one layer, stored as centre and half-width for a fast bound.

    ``max(q_i hi_i, q_i lo_i) = q_i m_i + |q_i| w_i`` with ``m = (hi + lo) / 2`` and
    ``w = (hi - lo) / 2``, so the bound of all pages is two batched matrix products.
    """

    def __init__(self, lo: np.ndarray, hi: np.ndarray) -> None:
        lo = np.asarray(lo, dtype=np.float64)
        hi = np.asarray(hi, dtype=np.float64)
        # stored in float32 (memory: a long Voxtral trace has ~10^7 digest entries per policy)
        if lo.shape != hi.shape or lo.ndim != 3:
            raise ValueError(f"page digests must be (H_kv, n_pages, D), got {lo.shape}, {hi.shape}")
        self.n_kv_heads, self.n_pages, self.head_dim = lo.shape
        mid, half = (hi + lo) / 2.0, (hi - lo) / 2.0
        self._mid_t = np.ascontiguousarray(mid.transpose(0, 2, 1), dtype=np.float32)  # (H_kv,D,P)
        self._half_t = np.ascontiguousarray(half.transpose(0, 2, 1), dtype=np.float32)

    def upper_bound(self, query: np.ndarray) -> np.ndarray:
        """(H_kv, g, n_pages) bound for the (H_q, D) query (float32 arithmetic)."""
        h_q = query.shape[0]
        if query.ndim != 2 or query.shape[1] != self.head_dim or h_q % self.n_kv_heads:
            raise ValueError(
                f"query shape {query.shape} does not match digests "
                f"({self.n_kv_heads}, {self.n_pages}, {self.head_dim})"
            )
        q = np.asarray(query, dtype=np.float32).reshape(self.n_kv_heads, -1, self.head_dim)
        return np.matmul(q, self._mid_t) + np.matmul(np.abs(q), self._half_t)


class LayerPageBoxes:
    """The :class:`PageBoxes` of every layer stacked, for the bounds of one step's queries of
    all layers in one batched product (the same per-(layer, KV-head) products as
    :meth:`PageBoxes.upper_bound`, so the same float32 results).

    Parameters
    ----------
    boxes : iterable of PageBoxes
        Every layer's boxes, in layer order, all of one shape. They are copied into the stack
        one at a time, so a generator that computes each layer's boxes when asked keeps only
        one layer's beside the stack (a list of every layer's would double their memory).
    n_layers : int
        Number of layers ``boxes`` yields.
    """

    def __init__(self, boxes: Iterable[PageBoxes], n_layers: int) -> None:
        filled = 0
        for layer, box in enumerate(boxes):
            if layer == 0:
                self.n_kv_heads, self.n_pages, self.head_dim = (
                    box.n_kv_heads, box.n_pages, box.head_dim)
                self._mid_t = np.empty((n_layers, *box._mid_t.shape), dtype=np.float32)
                self._half_t = np.empty_like(self._mid_t)  # both (L, H_kv, D, P)
            self._mid_t[layer], self._half_t[layer] = box._mid_t, box._half_t
            filled = layer + 1
        if filled != n_layers or not filled:
            raise ValueError(f"LayerPageBoxes: {filled} layers of boxes given, {n_layers} expected")

    def upper_bound(self, queries: np.ndarray) -> np.ndarray:
        """(L, H_kv, g, n_pages) bound for the (L, H_q, D) queries (float32 arithmetic)."""
        n_layers = self._mid_t.shape[0]
        if queries.shape[0] != n_layers or queries.ndim != 3:
            raise ValueError(f"queries {queries.shape} do not match {n_layers} layers of digests")
        q = np.asarray(queries, dtype=np.float32).reshape(
            n_layers, self.n_kv_heads, -1, self.head_dim)
        return np.matmul(q, self._mid_t) + np.matmul(np.abs(q), self._half_t)


class PageDigests:
    """One policy's page boxes, every layer's from its audio keys by one digest function
    (:func:`minmax_digest` for Quest, :func:`bounding_box_digest` for ArkVale).

    A layer's boxes are kept once :meth:`of` asks for them (decoding layer by layer); for a
    whole step (replay's ``select_layers``) :meth:`stacked` computes every layer's in turn into
    one :class:`LayerPageBoxes`, keeping none apart.
    """

    def __init__(self, digest: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
                 page_size: int) -> None:
        self._digest = digest
        self._page_size = page_size
        self._kept: dict[int, PageBoxes] = {}
        self._stacked: LayerPageBoxes | None = None

    def of(self, layer: int, keys: np.ndarray) -> PageBoxes:
        """``layer``'s boxes from its audio ``keys`` (H_kv, T_a, D), computed once and kept."""
        if layer not in self._kept:
            self._kept[layer] = self.computed(layer, keys)
        return self._kept[layer]

    def computed(self, layer: int, keys: np.ndarray) -> PageBoxes:
        """``layer``'s boxes: those :meth:`of` kept, else computed and not kept."""
        kept = self._kept.get(layer)
        return kept if kept is not None else PageBoxes(*self._digest(keys, self._page_size))

    def stacked(self, n_layers: int, keys_of: Callable[[int], np.ndarray]) -> LayerPageBoxes:
        """Every layer's boxes stacked (``keys_of(layer)``: its audio keys), computed once."""
        if self._stacked is None:
            self._stacked = LayerPageBoxes((self.computed(layer, keys_of(layer))
                                            for layer in range(n_layers)), n_layers)
        return self._stacked


def top_pages(scores: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` highest scores along the last axis (same ``k`` for all rows).

    Equal scores at the boundary are resolved by ``np.argpartition`` (introselect); every row
    is partitioned on its own, so a stack of rows (all layers of a step) gives the same rows
    as one call per row.
    """
    n = scores.shape[-1]
    if k <= 0:
        return np.zeros(scores.shape, dtype=bool)
    if k >= n:
        return np.ones(scores.shape, dtype=bool)
    flat = scores.reshape(-1, n)
    idx = np.argpartition(-flat, k - 1, axis=-1)[:, :k]
    out = np.zeros(flat.shape, dtype=bool)
    out[np.arange(flat.shape[0])[:, None], idx] = True
    return out.reshape(scores.shape)


def lowest_among(candidates: np.ndarray, k: np.ndarray, ascending: np.ndarray,
                 ascending_rank: np.ndarray) -> np.ndarray:
    """The ``k[row]`` lowest-scored candidate pages of every row, ties to the earlier page.

    Equal to ``topk_mask(np.where(candidates, -scores, -inf), k) & candidates`` for
    ``k <= candidates.sum(-1)``, given the scores' stable ascending order
    ``ascending = argsort(scores, kind="stable")`` and its inverse ``ascending_rank`` (both
    shared by every run at a step and layer): the candidates taken in that order, the first
    ``k`` of each row.

    Parameters
    ----------
    candidates : (R, P) bool
    k : (R,) int
    ascending, ascending_rank : (R, P) int
    """
    rows = np.arange(candidates.shape[0])[:, None]
    seen = np.cumsum(candidates[rows, ascending], axis=-1)  # candidates so far, in that order
    return candidates & (seen[rows, ascending_rank] <= k[:, None])


def top_page_reads(scores: np.ndarray, k: int, n_audio: int, page_size: int) -> np.ndarray:
    """Positions of the ``k`` best pages of every row (:func:`top_pages` then
    :func:`expand_pages`): Quest's reads, for one layer (H_kv, P) or a stack of layers."""
    return expand_pages(top_pages(scores, k), n_audio, page_size)


def recall_plan(resident: np.ndarray, forced: np.ndarray, scores: np.ndarray, topk: int,
                ascending: Callable[[], tuple[np.ndarray, np.ndarray]],
                ) -> tuple[np.ndarray, np.ndarray | None]:
    """ArkVale's page selection for one query (ArkVale §4, recall and eviction), over any
    leading shape: one layer (H_kv, P) or every layer of a step (L, H_kv, P).

    ``must`` = the ``forced`` pages and the ``topk`` best-scored others; every ``must`` page
    not yet ``resident`` is recalled and as many of the lowest-scored resident pages outside
    ``must`` are evicted (:func:`lowest_among`; ``ascending()`` gives the scores' stable
    ascending order and its inverse, asked only when a page is missing). Returns ``must`` and
    the new resident pages, or None when nothing is missing (the residents stay).
    """
    must = forced | top_pages(np.where(forced, -np.inf, scores), topk)
    missing = must > resident  # bool: must & ~resident
    if not missing.any():
        return must, None
    order, rank = ascending()
    n = resident.shape[-1]
    lowest = lowest_among((resident > must).reshape(-1, n), missing.sum(axis=-1).ravel(),
                          order.reshape(-1, n), rank.reshape(-1, n))
    return must, (resident > lowest.reshape(resident.shape)) | missing


def reduce_group(values: np.ndarray, how: str) -> np.ndarray:
    """Aggregate a (..., H_kv, g, P) per-q-head array over the GQA group axis -> (..., H_kv, P)."""
    if how == "max":
        return values.max(axis=-2)
    if how == "mean":
        return values.mean(axis=-2)
    if how == "sum":
        return values.sum(axis=-2)
    raise ValueError(f"group_reduce must be 'max', 'mean' or 'sum', got {how!r}")


def _check_keys(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.ndim != 3 or keys.shape[1] == 0:
        raise ValueError(f"audio keys must have shape (H_kv, T_a>0, D), got {keys.shape}")
    return keys
