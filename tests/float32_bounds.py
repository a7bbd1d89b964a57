"""Worst-case float32 rounding bounds for tests that compare float32 code with a float64
reference.

A tolerance built from these holds on any IEEE-754 machine, whatever BLAS kernel, SIMD width
or summation order the CPU selects: each is the classical a-priori bound (Higham, *Accuracy and
Stability of Numerical Algorithms*, §3.1) ``γ_n = n·u / (1 − n·u)`` for a sum or dot product
of ``n`` terms in any order, with ``u = 2⁻²⁴`` the unit roundoff of float32. Vectorised
``exp`` in numpy and torch is accurate to a few ulps: :data:`EXP_ULPS` allows for 4.
"""

from __future__ import annotations

import numpy as np

U32 = 2.0**-24  #: unit roundoff of float32
EXP_ULPS = 4  #: error of a vectorised float32 exp, in units of u (numpy's SIMD exp: < 4)


def gamma(n: int | np.ndarray, u: float = U32) -> np.ndarray | float:
    """``γ_n``: relative error bound of an n-term float sum or dot product in any order."""
    nu = np.asarray(n, dtype=np.float64) * u
    return nu / (1.0 - nu)


def logit_bound(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Absolute error bound of float32 ``q·kᵀ/√d`` per (query row, key).

    ``q`` (..., D) and ``k`` (..., N, D) in float64 (the exact operands: float16 values are
    exact in float32). The dot product errs by at most ``γ_D Σ|q_d k_d|``, scaling by 1/√d adds
    one rounding of the result.
    """
    d = q.shape[-1]
    mag = np.einsum("...d,...nd->...n", np.abs(q), np.abs(k)) / np.sqrt(d)
    exact = np.einsum("...d,...nd->...n", q, k) / np.sqrt(d)
    return gamma(d) * mag + U32 * np.abs(exact)


def softmax_rel_bound(logit_err: np.ndarray, n: int) -> np.ndarray:
    """Relative error bound of each float32 softmax probability over ``n`` positions, given
    absolute logit errors ``logit_err`` (..., n).

    Perturbing the logits by at most Δ = max|δ| scales every probability by a factor within
    ``e^{±2Δ}``; then exp (EXP_ULPS·u), the n-term normaliser (γ_n) and the division (u).
    """
    delta = logit_err.max(axis=-1, keepdims=True)
    return np.expm1(2.0 * delta) + (EXP_ULPS + 1) * U32 + gamma(n)
