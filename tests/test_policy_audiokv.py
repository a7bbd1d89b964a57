"""AudioKV (our reading of WnW App. F): voice-guided budgets, FFT smoothing, α mix."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.policies._allocation import allocate, fft_lowpass
from kvsim.policies.audiokv import spectral_smooth, voice_guided_budgets
from kvsim.policies.base import MissingCalibrationError, Tier
from kvsim.policies.registry import make
from tests._zoo_a_views import make_ctx, random_prefill


def test_allocate_largest_remainder_and_cap() -> None:
    # shares 2.5, 2.5, 5: one leftover token, remainder tie -> lower index
    assert allocate(10, np.array([1.0, 1.0, 2.0]), 100).tolist() == [3, 2, 5]
    out = allocate(10, np.array([1.0, 1.0, 8.0]), 4)
    assert out.tolist() == [3, 3, 4]  # capped head's excess re-spread
    assert allocate(5, np.zeros(3), 10).sum() == 5
    assert allocate(50, np.ones(3), 10).tolist() == [10, 10, 10]


def test_voice_guided_budgets_hand_case() -> None:
    vs = np.array([[3.0, 1.0], [0.0, 0.0]])
    b = voice_guided_budgets(400, vs, 1000, 0.5)
    # 0.5 * 400 / 4 = 50 each, plus 200 * VS share (0.75, 0.25, 0, 0)
    assert b.tolist() == [[200, 100], [50, 50]]
    assert voice_guided_budgets(400, vs, 1000, 1.0).tolist() == [[100, 100], [100, 100]]


def test_fft_lowpass_removes_high_frequency_keeps_mean() -> None:
    n = 64
    t = np.arange(n)
    slow, fast = np.cos(2 * np.pi * 2 * t / n), np.cos(2 * np.pi * 30 * t / n)
    out = fft_lowpass(1.0 + slow + fast, 0.7)  # 33 bins, keep 24: bin 30 removed
    np.testing.assert_allclose(out, 1.0 + slow, atol=1e-9)
    np.testing.assert_allclose(fft_lowpass(fast, 1.0), fast, atol=1e-9)


def test_spectral_smooth_alpha_mix() -> None:
    x = np.random.default_rng(0).uniform(size=(3, 40))
    np.testing.assert_allclose(spectral_smooth(x, 0.0, 0.7), x)
    np.testing.assert_allclose(spectral_smooth(x, 1.0, 0.7), fft_lowpass(x, 0.7))
    np.testing.assert_allclose(spectral_smooth(x, 0.5, 0.7), 0.5 * x + 0.5 * fft_lowpass(x, 0.7))


@pytest.mark.parametrize("r", [0.2, 0.4, 0.6, 0.8])
def test_audiokv_r_gpu_on_target_and_follows_voice_score(r: float) -> None:
    vs = np.array([[0.9, 0.1], [0.5, 0.3], [0.0, 0.2]])
    ctx = make_ctx(3, 4, 2, 120, voice_score=vs)
    pol = make("audiokv", r)
    tiers = pol.prefill(ctx, random_prefill(ctx))
    gpu = (tiers == Tier.GPU).sum(-1)
    assert abs(gpu.sum() / ctx.audio_kv_total - r) <= 0.01
    assert gpu.sum() == ctx.budget_tokens(r) == pol.gpu_capacity()
    np.testing.assert_array_equal(gpu, pol.head_budgets_)
    assert gpu[0, 0] >= gpu[1, 0] >= gpu[0, 1]  # ordered as VS (up to the T_a cap)


def test_audiokv_needs_head_scores() -> None:
    ctx = make_ctx()
    with pytest.raises(MissingCalibrationError):
        make("audiokv", 0.5).prefill(ctx, random_prefill(ctx))
