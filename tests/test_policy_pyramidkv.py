"""PyramidKV: arithmetic layer budgets with the uniform total; SnapKV top-k inside a layer."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies.base import Tier
from kvsim.policies.pyramidkv import pyramid_layer_budgets
from kvsim.policies.registry import make
from tests._zoo_a_views import make_ctx, random_prefill


def test_layer_budgets_hand_case() -> None:
    # b = 40, beta = 20: b_min = 2, b_max = 78, step (78 - 2) / 4 = 19
    assert pyramid_layer_budgets(40, 5, 1000, 20.0).tolist() == [78, 59, 40, 21, 2]


def test_layer_budgets_clip_to_audio_and_keep_total() -> None:
    b = pyramid_layer_budgets(60, 4, 100, 20.0)  # b_max = 117 > T_a = 100
    # reference rule: b_max = T_a = 100, b_min = 2*60 - 100 = 20, linear in between
    assert b.tolist() == [100, 73, 47, 20] and b.sum() == 240


def test_beta_one_is_flat() -> None:
    assert pyramid_layer_budgets(10, 3, 50, 1.0).tolist() == [10, 10, 10]


@pytest.mark.parametrize("r", [0.2, 0.4, 0.6, 0.8])
def test_pyramidkv_r_gpu_on_target_and_decreasing(r: float) -> None:
    ctx = make_ctx(4, 4, 2, 150)
    pol = make("pyramidkv", r)
    tiers = pol.prefill(ctx, random_prefill(ctx))
    gpu = tiers == Tier.GPU
    assert abs(gpu.sum() / ctx.audio_kv_total - r) <= 0.01
    per_layer = gpu.sum(axis=(1, 2))
    assert (np.diff(per_layer) <= 0).all() and per_layer[0] > per_layer[-1]
    assert int(gpu.sum()) == pol.gpu_capacity()
