"""Quest and ArkVale's fast paths against the straightforward per-run, per-layer selection.

The fast paths share what does not depend on the budget (page bounds, their ascending order)
through a memo per step and layer, evict with a cumulative count along the shared order, and
in replay select every layer of a step at once. Here several budgets share one memo, exactly
as in the replay engine, and every ``select`` result and tier array must equal, bit for bit,
the direct computation below (the policies' code before the fast paths), on random inputs and
on quantised keys where bounds tie often.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo_fakes import make_ctx, random_prefill

from kvsim.policies import PolicyNotApplicable, Tier, make
from kvsim.policies._pages import (
    PageBoxes,
    bounding_box_digest,
    expand_pages,
    lowest_among,
    minmax_digest,
    reduce_group,
    top_pages,
)
from kvsim.policies.base import ArrayQueryView, ArrayStepQueryView, topk_mask


def _reference_arkvale_select(pol, state: dict, layer: int, q: np.ndarray, keys: np.ndarray):
    """ArkVale's select written directly (the pre-fast-path code, stable top-k)."""
    per_q = PageBoxes(*bounding_box_digest(keys, pol.page_size)).upper_bound(q)
    scores = pol._combine(per_q)
    must = pol._forced | top_pages(np.where(pol._forced, -np.inf, scores), pol.topk)
    resident = state["resident"][layer]
    missing = must & ~resident
    new = resident
    if missing.any():
        evictable = resident & ~must
        lowest = topk_mask(np.where(evictable, -scores, -np.inf), missing.sum(axis=-1))
        new = (resident & ~(lowest & evictable)) | missing
        state["resident"][layer] = new
        on_gpu = expand_pages(new, state["n_audio"], pol.page_size)
        state["tiers"][layer] = np.where(on_gpu, Tier.GPU, Tier.CPU)
    read = must if pol.sparse_read else new
    return expand_pages(read, state["n_audio"], pol.page_size)


def _queries(rng: np.random.Generator, shape: tuple[int, ...], quantised: bool) -> np.ndarray:
    x = rng.normal(size=shape)
    return (np.round(x) if quantised else x).astype(np.float32)


def _prefilled(pol, ctx, prefill) -> np.ndarray | None:
    """``pol``'s prefill tiers, or None when its budget holds no page of this input (the
    policy refuses it: PolicyNotApplicable, asserted to be the zero page budget)."""
    try:
        return pol.prefill(ctx, prefill)
    except PolicyNotApplicable as exc:
        assert "= 0 pages" in str(exc) or "no page fits" in str(exc)
        return None


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n_audio=st.integers(20, 300),
    page_size=st.sampled_from([4, 8, 32]),
    topk_fraction=st.sampled_from([0.3, 0.5, 1.0]),
    group_reduce=st.sampled_from(["max", "mean", "sum"]),
    share_heads=st.booleans(),
    sparse_read=st.booleans(),
    budget_unit=st.sampled_from(["tokens", "pages"]),
    quantised=st.booleans(),
)
def test_arkvale_fast_select_equals_reference(
    seed: int, n_audio: int, page_size: int, topk_fraction: float, group_reduce: str,
    share_heads: bool, sparse_read: bool, budget_unit: str, quantised: bool,
) -> None:
    rng = np.random.default_rng(seed)
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4, n_audio=n_audio, seed=seed)
    prefill = random_prefill(ctx, seed=seed)
    if quantised:  # integer keys and queries: many pages with equal bounds
        prefill.keys[...] = np.round(prefill.keys)
    params = dict(page_size=page_size, topk_fraction=topk_fraction, group_reduce=group_reduce,
                  share_heads=share_heads, sparse_read=sparse_read, budget_unit=budget_unit)
    pols, refs = [], []
    for r in (0.15, 0.3, 0.5, 0.8, 1.0):
        pol = make("arkvale", r, **params)
        if (tiers := _prefilled(pol, ctx, prefill)) is not None:
            pols.append(pol)
            refs.append({"resident": pol._resident.copy(), "tiers": tiers.copy(), "n_audio": n_audio})
    for step in range(6):
        for layer in range(ctx.heads.n_layers):
            q = _queries(rng, (4, 4), quantised)
            view = ArrayQueryView(step, layer, q, prefill.keys[layer], memo={})
            for pol, ref in zip(pols, refs, strict=True):
                got = pol.select(view)
                want = _reference_arkvale_select(pol, ref, layer, q, prefill.keys[layer])
                assert got.dtype == bool and np.array_equal(got, want)
                assert np.array_equal(pol.current_tiers(), ref["tiers"])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n_audio=st.integers(1, 200),
    page_size=st.sampled_from([1, 4, 16]),
    group_reduce=st.sampled_from(["max", "mean", "sum"]),
    quantised=st.booleans(),
)
def test_quest_fast_select_equals_reference(
    seed: int, n_audio: int, page_size: int, group_reduce: str, quantised: bool
) -> None:
    rng = np.random.default_rng(seed)
    ctx = make_ctx(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=4, n_audio=n_audio, seed=seed)
    keys = _queries(rng, (2, n_audio, 4), quantised)
    pols = [make("quest", r, page_size=page_size, group_reduce=group_reduce)
            for r in (0.1, 0.25, 0.5, 0.9, 1.0)]
    pols = [pol for pol in pols if _prefilled(pol, ctx, random_prefill(ctx)) is not None]
    for step in range(4):
        q = _queries(rng, (4, 4), quantised)
        view = ArrayQueryView(step, 0, q, keys, memo={})
        scores = reduce_group(PageBoxes(*minmax_digest(keys, page_size)).upper_bound(q), group_reduce)
        for pol in pols:
            want = expand_pages(top_pages(scores, pol.page_budget), n_audio, page_size)
            got = pol.select(view)
            assert got.dtype == bool and np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 4), n=st.integers(1, 40),
       quantised=st.booleans())
def test_page_helpers(seed: int, rows: int, n: int, quantised: bool) -> None:
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(rows, n))
    if quantised:
        scores = np.round(scores)
    for k in range(n + 2):  # a stack of rows partitions like one row at a time
        stacked = top_pages(scores, k)
        assert np.array_equal(stacked, np.stack([top_pages(row, k) for row in scores]))
        assert (stacked.sum(axis=-1) == min(max(k, 0), n)).all()
    cand = rng.random((rows, n)) < 0.6
    k = rng.integers(0, cand.sum(axis=-1) + 1)
    order = np.argsort(scores, axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1)
    want = topk_mask(np.where(cand, -scores, -np.inf), k) & cand
    assert np.array_equal(lowest_among(cand, k, order, rank), want)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n_audio=st.integers(20, 200),
    page_size=st.sampled_from([4, 16, 32]),
    group_reduce=st.sampled_from(["max", "mean", "sum"]),
    share_heads=st.booleans(),
    sparse_read=st.booleans(),
    quantised=st.booleans(),
)
def test_select_layers_equals_select_layer_by_layer(
    seed: int, n_audio: int, page_size: int, group_reduce: str, share_heads: bool,
    sparse_read: bool, quantised: bool,
) -> None:
    """The replay fast path (all layers of a step at once, one memo per step shared by every
    budget) gives the reads and tiers of ``select`` called layer by layer, bit for bit."""
    rng = np.random.default_rng(seed)
    ctx = make_ctx(n_layers=3, n_q_heads=6, n_kv_heads=2, head_dim=4, n_audio=n_audio, seed=seed)
    prefill = random_prefill(ctx, seed=seed)
    if quantised:
        prefill.keys[...] = np.round(prefill.keys)
    specs = [("arkvale", r, dict(page_size=page_size, group_reduce=group_reduce,
                                 share_heads=share_heads, sparse_read=sparse_read))
             for r in (0.2, 0.5, 0.9)]
    specs += [("quest", r, dict(page_size=page_size, group_reduce=group_reduce,
                                dense_layers=int(seed % 2))) for r in (0.2, 0.7)]
    pairs = [(make(n, r, **kw), make(n, r, **kw)) for n, r, kw in specs]
    pairs = [(f, s) for f, s in pairs
             if _prefilled(f, ctx, prefill) is not None and _prefilled(s, ctx, prefill) is not None]
    fast, slow = [f for f, _ in pairs], [s for _, s in pairs]
    keys = [prefill.keys[layer] for layer in range(3)]
    for step in range(6):
        queries = _queries(rng, (3, 6, 4), quantised)
        view = ArrayStepQueryView(step, queries, keys, memo={})
        got = [pol.select_layers(view) for pol in fast]
        for layer in range(3):
            lview = ArrayQueryView(step, layer, queries[layer], keys[layer], memo={})
            for pol, reads in zip(slow, got, strict=True):
                want = pol.select(lview)
                if want is None:  # Quest's dense layers: every position (all on GPU)
                    want = np.ones_like(reads[layer])
                assert reads.dtype == bool and np.array_equal(reads[layer], want)
        for a, b in zip(fast, slow, strict=True):
            if a.current_tiers() is not None:
                assert np.array_equal(a.current_tiers(), b.current_tiers())


def test_page_digests_keep_a_layer_once_and_stack_without_keeping():
    """Quest's and ArkVale's digests: a layer asked for is computed once and kept; the stack
    of every layer asks each layer's keys once, keeps nothing apart, reuses what was kept."""
    from kvsim.policies._pages import PageDigests

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((3, 2, 37, 8)).astype(np.float32)  # (L, H_kv, T_a, D)
    calls: list[int] = []

    def digest(k, page_size):
        calls.append(page_size)
        return minmax_digest(k, page_size)

    pages = PageDigests(digest, 5)
    assert pages.of(1, keys[1]) is pages.of(1, keys[1]) and calls == [5]
    fresh = pages.computed(0, keys[0])
    assert fresh is not pages.computed(0, keys[0]) and len(calls) == 3  # not kept
    asked: list[int] = []
    stack = pages.stacked(3, lambda layer: asked.append(layer) or keys[layer])
    assert pages.stacked(3, lambda layer: 1 / 0) is stack and asked == [0, 1, 2]
    assert len(calls) == 5  # layer 1 came from what was kept
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    want = np.stack([PageBoxes(*minmax_digest(keys[i], 5)).upper_bound(q[i]) for i in range(3)])
    np.testing.assert_array_equal(stack.upper_bound(q), want)
