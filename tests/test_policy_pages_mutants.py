"""Quest, ArkVale and their page helpers: the properties mutation testing found untested.

Hyper-parameter errors name the policy and the field; the page helpers refuse malformed
arrays with one line; digests and bounds keep their float32 contract; ArkVale's page plan
(page budget, window pages, top-k floor, capacity) on hand cases; masks handed out stay
read-only and follow every recall; page bounds are computed once per step for all the runs
that share a geometry, and runs of different geometries never share them.
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo_fakes import FakePrefill, make_ctx, random_prefill

from kvsim.policies import PolicyNotApplicable, Tier, make
from kvsim.policies import arkvale as arkvale_module
from kvsim.policies._pages import (
    LayerPageBoxes,
    PageBoxes,
    bounding_box_digest,
    minmax_digest,
    n_pages,
    reduce_group,
    top_pages,
)
from kvsim.policies.base import ArrayQueryView, ArrayStepQueryView


# ----------------------------------------------------------------------------- hyper-parameters
@pytest.mark.parametrize(
    ("name", "params", "msg"),
    [
        ("arkvale", {"page_size": 0}, "arkvale: page_size must be >= 1, got 0"),
        ("arkvale", {"page_size": 2.0}, "arkvale: page_size must be an integer, got 2.0"),
        ("arkvale", {"n_sink_pages": -1}, "arkvale: n_sink_pages must be >= 0, got -1"),
        ("arkvale", {"n_window_pages": -1}, "arkvale: n_window_pages must be >= 0, got -1"),
        ("arkvale", {"topk_fraction": 0.0}, r"arkvale: topk_fraction must be in \(0, 1\], got 0.0"),
        ("arkvale", {"topk_fraction": 1.5}, r"arkvale: topk_fraction must be in \(0, 1\], got 1.5"),
        ("arkvale", {"group_reduce": "median"}, "arkvale: group_reduce must be one of"),
        ("arkvale", {"sparse_read": 1}, "arkvale: sparse_read must be True or False, got 1"),
        ("arkvale", {"budget_unit": "bytes"}, "arkvale: budget_unit must be one of"),
        ("arkvale", {"share_heads": "yes"}, "arkvale: share_heads must be True or False"),
        ("quest", {"page_size": 0}, "quest: page_size must be >= 1, got 0"),
        ("quest", {"page_size": "16"}, "quest: page_size must be an integer"),
        ("quest", {"group_reduce": "median"}, "quest: group_reduce must be one of"),
        ("quest", {"dense_layers": -1}, "quest: dense_layers must be >= 0, got -1"),
    ],
)
def test_bad_hyperparameters_give_one_line_errors(name: str, params: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        make(name, 0.2, **params)


def test_range_edges_are_accepted() -> None:
    for params in ({"page_size": 1}, {"n_sink_pages": 0}, {"n_window_pages": 0},
                   {"topk_fraction": 1.0}, {"topk_fraction": 1e-6}):
        make("arkvale", 0.2, **params)
    for params in ({"page_size": 1}, {"dense_layers": 0}):
        make("quest", 0.2, **params)


# ----------------------------------------------------------------------------- page helpers
def test_page_helpers_refuse_malformed_input_with_one_line() -> None:
    with pytest.raises(ValueError, match="page_size must be positive, got 0"):
        n_pages(10, 0)
    for keys in (np.zeros((2, 5)), np.zeros((2, 0, 4)), np.zeros((1, 2, 3, 4))):
        for digest in (minmax_digest, bounding_box_digest):
            with pytest.raises(ValueError, match=r"audio keys must have shape \(H_kv, T_a>0, D\)"):
                digest(keys.astype(np.float32), 4)
    with pytest.raises(ValueError, match="group_reduce must be 'max', 'mean' or 'sum', got 'median'"):
        reduce_group(np.zeros((2, 2, 3)), "median")


def test_page_boxes_refuse_mismatched_digests_and_queries() -> None:
    lo = np.zeros((2, 3, 4), dtype=np.float32)
    for bad_lo, bad_hi in ((lo, np.zeros((2, 3, 5))), (lo[0], lo[0])):
        with pytest.raises(ValueError, match=r"page digests must be \(H_kv, n_pages, D\)"):
            PageBoxes(bad_lo, bad_hi)
    boxes = PageBoxes(lo, lo + 1)
    for query in (np.zeros((4, 4, 1)), np.zeros((4, 5)), np.zeros((3, 4))):
        with pytest.raises(ValueError, match=r"query shape .* does not match digests \(2, 3, 4\)"):
            boxes.upper_bound(query)


def test_layer_page_boxes_refuse_missing_layers_and_mismatched_queries() -> None:
    box = PageBoxes(np.zeros((2, 3, 4)), np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match="0 layers of boxes given, 1 expected"):
        LayerPageBoxes([], 1)
    with pytest.raises(ValueError, match="2 layers of boxes given, 3 expected"):
        LayerPageBoxes([box, box], 3)
    stack = LayerPageBoxes([box, box], 2)
    for queries in (np.zeros((3, 4, 4)), np.zeros((2, 16))):
        with pytest.raises(ValueError, match="do not match 2 layers of digests"):
            stack.upper_bound(queries)


def test_digests_are_float32_and_bounds_use_float32_arithmetic() -> None:
    """Digests are the float32 boxes a GPU keeps; a float64 query is rounded to float32 first
    (the bound of a query equals the bound of its float32 rounding, bit for bit)."""
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(2, 37, 4)).astype(np.float32)
    for digest in (minmax_digest, bounding_box_digest):
        lo, hi = digest(keys, 8)
        assert lo.dtype == hi.dtype == np.float32
        boxes = PageBoxes(lo, hi)
        q64 = rng.normal(size=(4, 4))  # float64, not a float32 value
        got = boxes.upper_bound(q64)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, boxes.upper_bound(q64.astype(np.float32)))
        stacked = LayerPageBoxes([boxes, boxes], 2).upper_bound(np.stack([q64, -q64]))
        assert stacked.dtype == np.float32
        np.testing.assert_array_equal(stacked[1], boxes.upper_bound((-q64).astype(np.float32)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 3), n=st.integers(2, 60),
       data=st.data())
def test_top_pages_are_the_k_highest(seed: int, rows: int, n: int, data: st.DataObject) -> None:
    """With distinct scores the mask is exactly the k highest of each row (a full sort)."""
    scores = np.random.default_rng(seed).permutation(rows * n).reshape(rows, n).astype(float)
    k = data.draw(st.integers(1, n), label="k")
    want = np.zeros_like(scores, dtype=bool)
    np.put_along_axis(want, np.argsort(-scores, axis=-1)[:, :k], True, axis=-1)
    np.testing.assert_array_equal(top_pages(scores, k), want)


def test_top_page_of_a_long_row_is_its_maximum() -> None:
    """k = 1 of 5,000 pages: the partition must put the k-th highest in place (a partition at
    another rank leaves an arbitrary page first on long rows)."""
    scores = np.random.default_rng(0).permutation(5000).astype(float)[None]
    assert np.flatnonzero(top_pages(scores, 1)).tolist() == [int(scores.argmax())]


# ----------------------------------------------------------------------------- ArkVale's page plan
def _arkvale(r: float, n_audio: int, **params):
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, n_audio=n_audio)
    pol = make("arkvale", r, **params)
    return pol, pol.prefill(ctx, random_prefill(ctx)), ctx


def test_page_budget_of_an_exact_product() -> None:
    """floor(r · n) holds when r · n is an integer: r = 0.5 of 4 pages is 2 pages, and of 126
    tokens 63 tokens, which hold one free page of 32."""
    pol, _, _ = _arkvale(0.5, 128, budget_unit="pages")
    assert pol.page_budget == 2
    pol, _, _ = _arkvale(0.5, 126, n_sink_pages=0, n_window_pages=0)
    assert pol.page_budget == 1


@settings(max_examples=200, deadline=None)
@given(n_audio=st.integers(1, 400), page_size=st.sampled_from([1, 3, 8, 32]),
       n_sink=st.integers(0, 3), n_window=st.integers(0, 3), r=st.floats(0.01, 1.0))
def test_token_budget_is_met_within_one_page(n_audio: int, page_size: int, n_sink: int,
                                             n_window: int, r: float) -> None:
    """``budget_unit="tokens"``: the GPU holds at most floor(r · T_a) audio tokens per head
    and less than one page fewer, in at most every page."""
    ctx = make_ctx(n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=2, n_audio=n_audio)
    pol = make("arkvale", r, page_size=page_size, n_sink_pages=n_sink, n_window_pages=n_window)
    try:
        pol.prefill(ctx, random_prefill(ctx))
    except PolicyNotApplicable:
        assert pol.page_budget == 0
        return
    tokens = int(np.floor(r * n_audio + 1e-9))
    per_head = pol.gpu_capacity() // ctx.heads.n_heads_total
    assert tokens - page_size < per_head <= tokens
    assert pol.page_budget <= n_pages(n_audio, page_size)


def test_window_pages_are_the_last_ones() -> None:
    """n_window_pages = 2 of 5 pages: pages 3 and 4 (with sink page 0) are resident."""
    pol, tiers, _ = _arkvale(0.6, 160, n_window_pages=2)
    assert pol.page_budget == 3
    on_gpu = np.flatnonzero(tiers[0, 0] == Tier.GPU)
    assert on_gpu.tolist() == [*range(32), *range(96, 160)]


def test_topk_is_at_least_one_page_and_at_most_the_free_pages() -> None:
    """k = floor(fraction · P) − forced pages, raised to 1 while a free slot exists."""
    pol, _, _ = _arkvale(0.5, 320, topk_fraction=0.1)  # P = 5, 2 forced: k = 0 - 2
    assert (pol.page_budget, pol.topk) == (5, 1)
    pol, _, _ = _arkvale(0.5, 320, topk_fraction=1.0)
    assert pol.topk == 3


def test_capacity_counts_the_largest_free_pages() -> None:
    """Pages of 32, 32 and 6 tokens, one free page: a full page's 32 tokens per head."""
    pol, _, ctx = _arkvale(0.34, 70, n_sink_pages=0, n_window_pages=0, budget_unit="pages")
    assert pol.page_budget == 1
    assert pol.gpu_capacity() == 32 * ctx.heads.n_heads_total


def test_prefill_without_window_queries_keeps_the_first_free_pages() -> None:
    """No observation window: every page scores 0, the ties go to the earlier pages."""
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, n_audio=160)
    full = random_prefill(ctx)
    empty = FakePrefill(full.attention[:, :, :0], full.keys)
    tiers = make("arkvale", 0.6, n_sink_pages=0, n_window_pages=0).prefill(ctx, empty)
    assert tiers.shape == (2, 2, 160)
    assert (tiers[..., :96] == Tier.GPU).all() and (tiers[..., 96:] == Tier.CPU).all()


# ----------------------------------------------------------------------------- masks after recalls
def _flip_case():
    """One layer, one head, pages [0..3] (keys -1) and [4..7] (keys +1), one resident page:
    the prefill keeps page 0; a positive query then needs page 1, which replaces it."""
    ctx = make_ctx(n_layers=1, n_q_heads=1, n_kv_heads=1, head_dim=1, n_audio=8)
    keys = np.array([-1.0] * 4 + [1.0] * 4, dtype=np.float32).reshape(1, 1, 8, 1)
    att = np.array([0.2] * 4 + [0.01] * 4, dtype=np.float32).reshape(1, 1, 1, 8)
    pol = make("arkvale", 0.5, page_size=4, n_sink_pages=0, n_window_pages=0)
    tiers = pol.prefill(ctx, FakePrefill(att, keys))
    assert (tiers[0, 0] == Tier.GPU).tolist() == [True] * 4 + [False] * 4
    return pol, keys


def test_a_recall_that_replaces_every_page_updates_the_tiers() -> None:
    pol, keys = _flip_case()
    reads = pol.select_layers(ArrayStepQueryView(0, np.ones((1, 1, 1), np.float32), [keys[0]]))
    want = [False] * 4 + [True] * 4
    assert reads[0, 0].tolist() == want
    assert (pol.current_tiers()[0, 0] == Tier.GPU).tolist() == want
    # the layer-by-layer path then reads the resident pages select_layers left
    mask = pol.select(ArrayQueryView(1, 0, np.ones((1, 1), np.float32), keys[0]))
    assert mask is not None and mask[0].tolist() == want


def test_masks_handed_out_are_read_only() -> None:
    """select returns the policy's own GPU mask, never a copy per call: it must be read-only,
    before and after a recall by either path."""
    pol, keys = _flip_case()
    before = pol.select(ArrayQueryView(0, 0, -np.ones((1, 1), np.float32), keys[0]))
    assert not before.flags.writeable
    after = pol.select(ArrayQueryView(1, 0, np.ones((1, 1), np.float32), keys[0]))  # recall
    assert not after.flags.writeable and before[0].tolist() == [True] * 4 + [False] * 4
    pol, keys = _flip_case()
    pol.select_layers(ArrayStepQueryView(0, np.ones((1, 1, 1), np.float32), [keys[0]]))
    again = pol.select(ArrayQueryView(1, 0, np.ones((1, 1), np.float32), keys[0]))
    assert not again.flags.writeable


# ----------------------------------------------------------------------------- shared bounds
_SPECS = [("arkvale", r, {}) for r in (0.2, 0.5, 0.8)] + [
    ("arkvale", 0.5, {"page_size": 16}), ("arkvale", 0.5, {"group_reduce": "mean"}),
    ("arkvale", 0.5, {"share_heads": True}),
    ("quest", 0.2, {}), ("quest", 0.6, {}), ("quest", 0.4, {"page_size": 8}),
    ("quest", 0.4, {"group_reduce": "sum"}),
]
_GEOMETRIES = 4 + 3  # distinct (policy, page_size, group_reduce, share_heads)


def _spy(owner, name: str):
    """``owner.name`` still called, its calls counted (``spy.call_count``)."""
    return mock.patch.object(owner, name, autospec=True, side_effect=getattr(owner, name))


@pytest.mark.parametrize("all_layers", [True, False])
def test_runs_share_bounds_per_geometry_and_only_within_it(all_layers: bool) -> None:
    """Runs of one geometry and several budgets compute the page bounds (and ArkVale's prefill
    page scores) once per step; each run selects, in this company, what it selects alone."""
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, n_audio=150)
    base = random_prefill(ctx, seed=3)
    together = [make(n, r, **kw) for n, r, kw in _SPECS]
    alone = [make(n, r, **kw) for n, r, kw in _SPECS]
    shared_prefill = replace(base, memo={})
    with _spy(arkvale_module, "last_query_page_max") as prefill_spy:
        for pol in together:
            pol.prefill(ctx, shared_prefill)
    assert prefill_spy.call_count == 4 * ctx.heads.n_layers  # ArkVale's 4 geometries, per layer
    for pol in alone:
        pol.prefill(ctx, replace(base, memo={}))
    rng = np.random.default_rng(4)
    keys = [base.keys[layer] for layer in range(2)]
    for step in range(5):
        queries = rng.normal(size=(2, 4, 4)).astype(np.float32)
        with _spy(LayerPageBoxes if all_layers else PageBoxes, "upper_bound") as bound_spy:
            got = _select_all(together, step, queries, keys, all_layers, shared=True)
        assert bound_spy.call_count == _GEOMETRIES * (1 if all_layers else 2)
        want = _select_all(alone, step, queries, keys, all_layers, shared=False)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def _select_all(pols, step, queries, keys, all_layers: bool, shared: bool) -> list[np.ndarray]:
    """Every run's reads of one step, on the engine's memo per step (all layers) or per step
    and layer (layer by layer) shared by the runs, or on a memo of each run's own."""
    memos = [{} for _ in range(len(keys))]
    out = []
    for pol in pols:
        if not shared:
            memos = [{} for _ in range(len(keys))]
        if all_layers:
            out.append(pol.select_layers(ArrayStepQueryView(step, queries, keys, memo=memos[0])))
            continue
        reads = [pol.select(ArrayQueryView(step, layer, queries[layer], keys[layer],
                                           memo=memos[layer])) for layer in range(len(keys))]
        out.append(np.stack([np.ones(keys[0].shape[:2], bool) if r is None else r for r in reads]))
    return out
