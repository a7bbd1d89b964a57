"""Worst-case float32 rounding bounds for tests that compare float32 code with a float64
reference.

A tolerance built from these holds on any IEEE-754 machine, whatever BLAS kernel, SIMD width
or summation order the CPU selects: each is the classical a-priori bound (Higham, *Accuracy and
Stability of Numerical Algorithms*, §3.1) ``γ_n = n·u / (1 − n·u)`` for a sum or dot product
of ``n`` terms in any order (blocked, pairwise, FMA or not), with ``u = 2⁻²⁴`` the unit
roundoff of float32. Vectorised ``exp`` in numpy and torch is accurate to a few ulps:
:data:`EXP_ULPS` allows for 4. The same bounds hold for torch's float32 CPU kernels (MKL,
oneDNN, ATen's vectorised loops): they too are sums and dot products in some order.

Two float32 computations of the same quantity (say numpy and torch, or one matrix product of
another width) differ by at most the sum of their bounds against the exact value. The float64
reference itself errs by ``γ_n`` with ``u = 2⁻⁵³``, some 10⁹ times less: the bounds below
ignore it (except :func:`dot_bound`), and they are first order in the float32 errors (the
neglected second-order terms are below 10⁻¹² relative).
"""

from __future__ import annotations

import numpy as np

U32 = 2.0**-24  #: unit roundoff of float32
U64 = 2.0**-53  #: unit roundoff of float64 (the references)
EXP_ULPS = 4  #: error of a vectorised float32 exp, in units of u (numpy's SIMD exp: < 4)
TINY32 = 2.0**-149  #: smallest float32 subnormal: bounds the absolute error of an underflow


def gamma(n: int | np.ndarray, u: float = U32) -> np.ndarray | float:
    """``γ_n``: relative error bound of an n-term float sum or dot product in any order."""
    nu = np.asarray(n, dtype=np.float64) * u
    return nu / (1.0 - nu)


def dot_bound(n: int, magnitude: np.ndarray | float) -> np.ndarray | float:
    """Bound on |float32 result − float64 reference| of an n-term dot product (or n roundings
    in all) whose terms have absolute sum ``magnitude``: ``γ_n`` of each, plus n underflows
    (inputs near float32's smallest normal lose their relative accuracy)."""
    return (gamma(n) + gamma(n, U64)) * magnitude + n * TINY32


def logit_bound(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Absolute error bound of the float32 shifted logits ``q·kᵀ/√d − max`` per (query, key),
    as a softmax computes them.

    ``q`` (..., D) and ``k`` (..., N, D) in float64 (the exact operands: float16 values are
    exact in float32), ``N`` every key the softmax runs over. The D-term dot product errs by at
    most ``γ_D Σ|q_d k_d|``; the scale ``1/√d`` is itself rounded and its product rounded once
    more (or ``q`` is scaled first: one rounding per term), so ``γ_{D+2}`` covers both orders.
    Subtracting the (computed) row maximum shifts every logit alike, which cancels in the
    softmax, and rounds once more, by ``u·|x̂ − max̂| ≤ u·(|x − max| + 2·max error)``.
    """
    d = q.shape[-1]
    mag = np.einsum("...d,...nd->...n", np.abs(q), np.abs(k)) / np.sqrt(d)
    exact = np.einsum("...d,...nd->...n", q, k) / np.sqrt(d)
    shifted = exact.max(axis=-1, keepdims=True) - exact
    dot_err = gamma(d + 2) * mag
    return dot_err + U32 * (shifted + 2 * dot_err.max(axis=-1, keepdims=True))


def softmax_rel_bound(logit_err: np.ndarray, n: int) -> np.ndarray:
    """Relative error bound of each float32 softmax probability over ``n`` positions, given
    absolute logit errors ``logit_err`` (..., n).

    Perturbing the logits by at most Δ = max|δ| scales every probability by a factor within
    ``e^{±2Δ}``; then exp (EXP_ULPS·u), the n-term normaliser (γ_n) and the division (u).
    """
    delta = logit_err.max(axis=-1, keepdims=True)
    return np.expm1(2.0 * delta) + (EXP_ULPS + 1) * U32 + gamma(n)


def renormalised_rel_bound(logit_err: np.ndarray, allowed: np.ndarray, z: np.ndarray,
                           n_audio: int) -> np.ndarray:
    """Relative error bound of ``P_i / ẑ``, ``ẑ = 1 − A + K``, as the replay engine computes a
    compressed model's attention from the float32 full softmax ``P`` over ``n`` keys (softmax
    over a subset is the renormalised restriction, WnW §3.4).

    ``logit_err`` (..., n) from :func:`logit_bound`, ``allowed`` (..., n) the positions read,
    ``z`` (..., 1) the exact mass of the full softmax on them, ``n_audio`` the terms of the
    float32 sums ``A`` (all audio mass) and ``K`` (kept audio mass). Write
    ``P_i/ẑ = [P_i / Σ_allowed P] · [Σ_allowed P / ẑ]``. In the first factor the full
    normaliser (and its rounding) cancels: the softmax over the allowed logits, within
    ``e^{±2Δ}`` for Δ their largest error, times exp's and the division's rounding of two terms.
    In the second, ``ẑ`` differs from ``Σ_allowed P`` by ``|1 − Σ P| ≤ γ_n + 2u`` (the float32
    softmax need not sum to 1), the sums' ``γ_{n_audio}(A + K) ≤ 2γ_{n_audio}``, and ``1 − A``
    and ``+ K`` rounding once each (≤ u each): relative to ``z``. The final division adds u.
    """
    n = logit_err.shape[-1]
    delta = np.where(allowed, logit_err, 0.0).max(axis=-1, keepdims=True)
    renorm = (gamma(n) + 2 * gamma(n_audio) + 4 * U32) / z
    return np.expm1(2.0 * delta) + 2 * (EXP_ULPS + 1) * U32 + renorm + U32


def attention_output_bound(p: np.ndarray, v: np.ndarray, e_p: np.ndarray) -> np.ndarray:
    """Absolute error bound of a float32 attention output ``Σ_i p_i v_i`` per coordinate.

    ``p`` (..., N) exact probabilities, ``v`` (..., N, D) exact values (float64), ``e_p``
    (..., 1 or N) the relative error of each float32 ``p_i``. The N-term product errs by
    ``γ_N Σ p_i |v_i|`` beyond the ``e_p`` already in its weights. An online (flash) softmax,
    as torch's CPU ``scaled_dot_product_attention`` computes, rescales its running sum by
    ``exp(m_old − m_new)`` once per key block: at most N rescales of (EXP_ULPS + 2)·u each.
    """
    n = p.shape[-1]
    weighted = np.einsum("...n,...nd->...d", p * (1.0 + e_p), np.abs(v))
    rescale = n * (EXP_ULPS + 2) * U32
    return (e_p.max(axis=-1, keepdims=True) + gamma(n) + rescale) * weighted

