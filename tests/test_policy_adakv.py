"""Ada-KV allocation pinned on hand-made scores; budget totals on random views."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies.adakv import adaptive_head_allocation, adaptive_head_budgets
from kvsim.policies.base import Tier
from kvsim.policies.registry import make
from tests._zoo_a_views import make_ctx, random_prefill

SCORES = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.1, 0.0, 0.0]])


def test_without_safeguard_the_layer_wide_topk_decides() -> None:
    # top 4 of the layer: 0.9, 0.8, 0.7, 0.6 -> all won by head 0
    assert adaptive_head_budgets(SCORES, 2, 0.0).tolist() == [4, 0]
    keep = adaptive_head_allocation(SCORES, per_head=2, floor_alpha=0.0)
    assert keep.tolist() == [[True] * 4, [False] * 4]


def test_safeguard_mixes_counts_with_uniform_share() -> None:
    # c = [4, 0]; b = 0.5*c + 0.5*2 = [3, 1]
    assert adaptive_head_budgets(SCORES, 2, 0.5).tolist() == [3, 1]
    keep = adaptive_head_allocation(SCORES, per_head=2, floor_alpha=0.5)
    assert keep.tolist() == [[True, True, True, False], [True, False, False, False]]
    # per_head 3: top 6 = 0.9 .8 .7 .6 (head 0), .5 .1 (head 1) -> c = [4, 2]
    # b = 0.2*c + 0.8*3 = [3.2, 2.8] -> largest remainder, total 6 -> [3, 3]
    assert adaptive_head_budgets(SCORES, 3, 0.8).tolist() == [3, 3]


def test_floor_alpha_one_is_uniform_snapkv() -> None:
    keep = adaptive_head_allocation(SCORES, per_head=2, floor_alpha=1.0)
    assert keep.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_spread_heads_win_budget_concentrated_heads_keep_the_floor() -> None:
    rng = np.random.default_rng(0)
    s = rng.uniform(size=(4, 50)) ** np.array([[1.0], [4.0], [8.0], [16.0]])  # flat -> peaky
    b = adaptive_head_budgets(s, per_head=10, floor_alpha=0.8)
    assert b.sum() == 40 and (b >= 8).all()  # floor: 80% of the uniform share
    assert b[0] > 10 > b[3]  # the spread-out head wins budget from the concentrated one
    assert (adaptive_head_allocation(s, 10, 0.8).sum(axis=1) == b).all()


@pytest.mark.parametrize("r", [0.2, 0.4, 0.6, 0.8])
def test_adakv_r_gpu_is_on_target(r: float) -> None:
    ctx = make_ctx(3, 8, 4, 137)
    tiers = make("adakv", r).prefill(ctx, random_prefill(ctx))
    measured = (tiers == Tier.GPU).sum() / ctx.audio_kv_total
    assert abs(measured - r) <= 0.01
    assert ((tiers == Tier.GPU).sum(axis=(1, 2)) == 4 * int(r * 137 + 1e-9)).all()
