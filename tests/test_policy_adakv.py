"""Ada-KV allocation pinned on hand-made scores; budget totals on random views."""

from __future__ import annotations

import numpy as np
import pytest

from policies.adakv import adaptive_head_allocation
from policies.base import Tier
from policies.registry import make
from tests._zoo_a_views import make_ctx, random_prefill

SCORES = np.array([[0.9, 0.8, 0.7, 0.6], [0.5, 0.1, 0.0, 0.0]])


def test_allocation_without_safeguard_is_a_layer_wide_topk() -> None:
    keep = adaptive_head_allocation(SCORES, per_head=2, floor_alpha=0.0)
    assert keep.tolist() == [[True] * 4, [False] * 4]  # head 1 gets nothing


def test_safeguard_guarantees_floor_alpha_of_the_uniform_share() -> None:
    keep = adaptive_head_allocation(SCORES, per_head=2, floor_alpha=0.5)
    # each head keeps its top floor(0.5*2)=1, the other 2 tokens go to the best remaining
    assert keep.tolist() == [[True, True, True, False], [True, False, False, False]]
    keep = adaptive_head_allocation(SCORES, per_head=4, floor_alpha=0.8)
    # per_head = T_a: everything is kept whatever the split
    assert keep.all()
    keep = adaptive_head_allocation(SCORES, per_head=3, floor_alpha=0.8)
    # floor(0.8*3)=2 each; the 2 remaining go to 0.7 (head 0) then 0.6 (head 0)
    assert keep.tolist() == [[True] * 4, [True, True, False, False]]


def test_floor_alpha_one_is_uniform_snapkv() -> None:
    keep = adaptive_head_allocation(SCORES, per_head=2, floor_alpha=1.0)
    assert keep.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_safeguard_on_larger_case() -> None:
    rng = np.random.default_rng(0)
    s = rng.uniform(size=(4, 50)) ** np.array([[1.0], [4.0], [8.0], [16.0]])
    keep = adaptive_head_allocation(s, per_head=10, floor_alpha=0.8)
    assert keep.sum() == 40 and (keep.sum(axis=1) >= 8).all()
    assert keep.sum(axis=1).max() > 10  # adaptive: not uniform


@pytest.mark.parametrize("r", [0.2, 0.4, 0.6, 0.8])
def test_adakv_r_gpu_is_on_target(r: float) -> None:
    ctx = make_ctx(3, 8, 4, 137)
    tiers = make("adakv", r).prefill(ctx, random_prefill(ctx))
    measured = (tiers == Tier.GPU).sum() / ctx.audio_kv_total
    assert abs(measured - r) <= 0.01
    assert ((tiers == Tier.GPU).sum(axis=(1, 2)) == 4 * int(r * 137 + 1e-9)).all()
