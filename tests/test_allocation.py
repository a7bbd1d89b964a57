"""The integer budget allocation shared by the score-based policies (policies/_allocation.py),
against an exact rational reference of its specification: water-filling in proportion to the
weights under per-item caps, then largest-remainder rounding."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.policies._allocation import allocate, fft_lowpass


def _exact_shares(total: int, weights: list[int], caps: list[int]) -> list[Fraction]:
    """Water-filling in exact arithmetic: each round spreads what is left over the uncapped
    items in proportion to their weights (uniformly if those are all zero) and fixes at
    their cap the items it would take past it."""
    total = min(total, sum(caps))
    w = [Fraction(x) for x in weights] if sum(weights) > 0 else [Fraction(1)] * len(weights)
    w = [x if c > 0 else Fraction(0) for x, c in zip(w, caps, strict=True)]
    if sum(w) == 0:
        w = [Fraction(int(c > 0)) for c in caps]
    share = [Fraction(0)] * len(w)
    free = [c > 0 for c in caps]
    remaining = Fraction(total)
    while remaining > 0 and any(free):
        wf = [x if f else Fraction(0) for x, f in zip(w, free, strict=True)]
        if sum(wf) == 0:
            wf = [Fraction(int(f)) for f in free]
        prop = [remaining * x / sum(wf) for x in wf]
        over = [f and s + p >= c for f, s, p, c in zip(free, share, prop, caps, strict=True)]
        if not any(over):
            share = [s + p for s, p in zip(share, prop, strict=True)]
            break
        remaining -= sum(c - s for o, s, c in zip(over, share, caps, strict=True) if o)
        share = [Fraction(c) if o else s for o, s, c in zip(over, share, caps, strict=True)]
        free = [f and not o for f, o in zip(free, over, strict=True)]
    return share


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), min_size=1, max_size=8),
       st.integers(0, 40))
def test_allocation_rounds_the_exact_water_filling_shares(items, total) -> None:
    """Every item gets its exact share rounded down or up, never past its cap; the sum is
    min(total, Σ caps); the items rounded up are those with the largest remainders."""
    weights, caps = [w for w, _ in items], [c for _, c in items]
    got = allocate(total, np.array(weights, dtype=float), np.array(caps))
    assert got.dtype == np.int64 and got.shape == (len(items),)
    assert int(got.sum()) == min(total, sum(caps))
    share = _exact_shares(total, weights, caps)
    assert all(0 <= g <= c for g, c in zip(got.tolist(), caps, strict=True))
    assert all(math.floor(s) <= g <= math.ceil(s) for g, s in zip(got.tolist(), share, strict=True))
    up = [i for i, (g, s) in enumerate(zip(got.tolist(), share, strict=True)) if g > math.floor(s)]
    down = [i for i, (g, s) in enumerate(zip(got.tolist(), share, strict=True))
            if g == math.floor(s) and s != math.floor(s)]
    for i in up:
        for j in down:  # no item left down has a larger remainder, nor an equal one before it
            rem_i, rem_j = share[i] - math.floor(share[i]), share[j] - math.floor(share[j])
            # remainders equal in exact arithmetic may differ in float64's last bits (2/3
            # against 5/3 - 1), which then decide; exact ties are the hand cases' business
            near_tie = abs(rem_i - rem_j) < Fraction(1, 10**9)
            assert rem_i > rem_j or (rem_i == rem_j and i < j) or near_tie


def test_allocation_hand_cases_with_caps_of_zero() -> None:
    assert allocate(6, np.array([1.0, 5.0, 1.0]), np.array([4, 0, 4])).tolist() == [3, 0, 3]
    assert allocate(3, np.array([0.0, 2.0]), np.array([5, 0])).tolist() == [3, 0]  # only a zero weight has room
    assert allocate(0, np.ones(3), 5).tolist() == [0, 0, 0]
    assert allocate(7, np.ones((2, 2)), 1).tolist() == [[1, 1], [1, 1]]  # shape kept, total clipped


@pytest.mark.parametrize(("total", "weights", "msg"), [
    (-1, [1.0], r"allocate: total must be >= 0, got -1"),
    (3, [1.0, -0.5], "allocate: weights must be finite and non-negative"),
    (3, [1.0, float("nan")], "allocate: weights must be finite and non-negative"),
    (3, [float("inf")], "allocate: weights must be finite and non-negative"),
])
def test_allocation_refuses_bad_input(total, weights, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        allocate(total, np.array(weights), 10)


def test_lowpass_keeps_the_dc_bin_of_short_rows_and_checks_its_fraction() -> None:
    np.testing.assert_allclose(fft_lowpass(np.array([[0.0, 2.0]]), 0.5), [[1.0, 1.0]])
    np.testing.assert_array_equal(fft_lowpass(np.array([3.0]), 0.5), [3.0])
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"keep_fraction must be in \(0, 1\], got {bad}"):
            fft_lowpass(np.ones(4), bad)


def test_lowpass_keeps_ceil_fraction_of_the_bins_of_any_row_length() -> None:
    """rFFT of 8 samples has 5 bins; keep_fraction 0.4 keeps ceil(2.0) = 2 (DC and bin 1).
    Odd lengths come back at their length; float32 input is filtered in float64."""
    t = np.arange(8)
    one, two = np.cos(2 * np.pi * t / 8), np.cos(2 * np.pi * 2 * t / 8)
    np.testing.assert_allclose(fft_lowpass(one + two, 0.4), one, atol=1e-12)
    odd = np.random.default_rng(0).uniform(size=(2, 7))
    np.testing.assert_allclose(fft_lowpass(odd, 1.0), odd, atol=1e-12)
    x32 = odd.astype(np.float32)
    assert fft_lowpass(x32, 0.5).dtype == np.float64
