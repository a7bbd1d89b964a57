"""ArkVale's page selection on the model's device (``policies/_pages_torch.py``,
``ArkVale.select_device``) against the NumPy selection it mirrors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsim.policies import _pages_torch as pt
from kvsim.policies._pages import PageBoxes, bounding_box_digest, lowest_among, recall_plan
from kvsim.policies.base import ArrayQueryView
from kvsim.policies.registry import make
from tests.float32_bounds import gamma
from tests.zoo_fakes import make_ctx, random_prefill


def _numpy_plan(resident, forced, scores, topk):
    def ascending():
        order = np.argsort(scores, axis=-1, kind="stable")
        return order, np.argsort(order, axis=-1)

    must, new = recall_plan(resident, forced, scores, topk, ascending)
    return must, resident if new is None else new


@pytest.mark.parametrize("shape", [(4, 25), (3, 2, 40)])
def test_the_device_plan_recalls_and_evicts_the_numpy_plans_pages(shape) -> None:
    """Given the same scores (distinct, so that the top-k is one set), the same pages must be
    resident and the same pages evicted, for every top-k from none to every free page."""
    rng = np.random.default_rng(0)
    n = shape[-1]
    forced = np.zeros(n, dtype=bool)
    forced[[0, n - 1]] = True
    for trial in range(40):
        resident = (rng.random(shape) < rng.uniform(0.2, 0.8)) | forced
        scores = rng.standard_normal(shape).astype(np.float32)
        topk = int(rng.integers(0, n - 1))
        must, new = _numpy_plan(resident, forced, scores, topk)
        must_t, new_t = pt.recall_plan(torch.tensor(resident), torch.tensor(forced),
                                       torch.tensor(scores), topk)
        assert (must_t.numpy() == must).all(), trial
        assert (new_t.numpy() == new).all(), trial


def test_the_device_eviction_breaks_ties_towards_the_earlier_page() -> None:
    """Evictions follow the scores' stable ascending order: with many equal scores the
    earliest candidates go first, as in the NumPy plan."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        candidates = rng.random((6, 30)) < 0.6
        scores = rng.integers(0, 3, size=(6, 30)).astype(np.float32)  # heavy ties
        k = np.minimum(rng.integers(0, 8, size=6), candidates.sum(-1))
        order = np.argsort(scores, axis=-1, kind="stable")
        expected = lowest_among(candidates, k, order, np.argsort(order, axis=-1))
        got = pt.lowest_among(torch.tensor(candidates), torch.tensor(k, dtype=torch.int32),
                              torch.tensor(scores))
        assert (got.numpy() == expected).all()


def test_device_page_bounds_equal_the_numpy_bounds_within_float32_rounding() -> None:
    """Each bound is a float32 sum of 2·D products; both lie within γ_2D of the float64 sum
    of the magnitudes of its terms."""
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((3, 100, 16)).astype(np.float32)
    boxes = PageBoxes(*bounding_box_digest(keys, 8))
    query = rng.standard_normal((6, 16)).astype(np.float32)
    host = boxes.upper_bound(query)
    device = pt.DevicePageBoxes(boxes._mid_t, boxes._half_t, torch.device("cpu")).upper_bound(
        torch.tensor(query)).numpy()
    q64 = np.abs(query.astype(np.float64)).reshape(3, 2, 16)
    magnitude = q64 @ (np.abs(boxes._mid_t.astype(np.float64)) + np.abs(boxes._half_t))
    np.testing.assert_array_less(np.abs(host - device), 2 * gamma(32) * magnitude + 1e-30)
    # a bfloat16 query (a CUDA model's) is bounded in float32 as its exact float32 value
    q16 = torch.tensor(query).to(torch.bfloat16)
    boxes_t = pt.DevicePageBoxes(boxes._mid_t, boxes._half_t, torch.device("cpu"))
    assert boxes_t.upper_bound(q16).dtype == torch.float32
    assert torch.equal(boxes_t.upper_bound(q16), boxes_t.upper_bound(q16.to(torch.float32)))


@pytest.mark.parametrize("params", [{}, {"page_size": 8, "sparse_read": True},
                                    {"share_heads": True, "group_reduce": "mean"}])
def test_select_device_reads_and_leaves_the_tiers_select_does(params) -> None:
    """Step after step, every layer: the positions read and, after ``sync_device_state``,
    the tiers are those of the host ``select`` (checked: the page scores are far apart
    compared with their rounding, so both kernels rank them alike)."""
    rng = np.random.default_rng(3)
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_audio=310, seed=3)
    prefill = random_prefill(ctx, seed=3)
    host, device = (make("arkvale", 0.4, **params) for _ in range(2))
    host.prefill(ctx, prefill)
    device.prefill(ctx, prefill)
    for step in range(6):
        for layer in range(ctx.heads.n_layers):
            q = (rng.standard_normal((4, 16)) * 3).astype(np.float32)
            view = ArrayQueryView(step, layer, q, prefill.keys[layer], memo={})
            scores = np.sort(host.page_scores(view), axis=-1)
            boxes = host.digest(layer, prefill.keys[layer])  # as in the bounds test above
            magnitude = np.abs(q).reshape(2, 2, 16) @ (np.abs(boxes._mid_t) + boxes._half_t)
            assert np.diff(scores, axis=-1).min() > 4 * gamma(32) * magnitude.max()
            read = host.select(view)
            read_t = device.select_device(layer, torch.tensor(q), prefill.keys[layer])
            assert read_t.dtype == torch.bool and (read_t.numpy() == read).all(), (step, layer)
        device.sync_device_state()
        assert (device.current_tiers() == host.current_tiers()).all(), step
    assert (host.current_tiers() != prefill_tiers(ctx, params)).any()  # pages were recalled


def prefill_tiers(ctx, params) -> np.ndarray:
    """The tiers right after prefill (what the steps above must have changed)."""
    return make("arkvale", 0.4, **params).prefill(ctx, random_prefill(ctx, seed=3))


def test_device_group_reduction_and_top_pages_edges_match_numpy() -> None:
    """Every GQA reduction over the group axis, an unknown one refused by name; the top-k of
    no page, of every page and of more pages than there are."""
    from kvsim.policies._pages import reduce_group, top_pages

    values = np.random.default_rng(4).standard_normal((3, 4, 7)).astype(np.float32)  # (H_kv, g, P)
    for how in ("max", "mean", "sum"):
        got = pt.reduce_group(torch.tensor(values), how).numpy()
        np.testing.assert_allclose(got, reduce_group(values, how), rtol=4 * gamma(4), atol=1e-6)
    with pytest.raises(ValueError, match="'max', 'mean' or 'sum', got 'median'"):
        pt.reduce_group(torch.tensor(values), "median")
    scores = torch.tensor(values[0])  # (4, 7)
    for k in (0, 7, 9):
        got = pt.top_pages(scores, k)
        assert got.dtype == torch.bool and got.shape == scores.shape
        assert (got.numpy() == top_pages(values[0], k)).all()


def test_select_device_computes_on_the_query_s_device() -> None:
    """The page boxes, the resident pages and the positions read live on the query's device
    (here PyTorch's shape-only ``meta`` device, which refuses to mix with host tensors)."""
    ctx = make_ctx(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=16, n_audio=310, seed=3)
    prefill = random_prefill(ctx, seed=3)
    pol = make("arkvale", 0.4)
    pol.prefill(ctx, prefill)
    for layer in range(2):
        read = pol.select_device(layer, torch.empty((4, 16), device="meta"), prefill.keys[layer])
        assert read.device.type == "meta" and read.shape == (2, 310) and read.dtype == torch.bool
