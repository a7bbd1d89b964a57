"""Checks of the rules a policy must keep (the protocol of :mod:`kvsim.policies.base`): tier arrays of
the right shape and values, GONE is absorbing, no more GPU audio than the policy's capacity."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvsim.core.tiers import TIER_GONE, TIER_GPU


class _HasCapacity(Protocol):
    def gpu_capacity(self) -> int | None: ...


class InvariantViolation(AssertionError):
    """A policy broke a rule of the policy protocol (:mod:`kvsim.policies.base`)."""


def check_tiers(name: str, tiers: np.ndarray, shape: tuple[int, ...]) -> None:
    """Shape, dtype and value checks on a tier array returned by a policy."""
    if not isinstance(tiers, np.ndarray) or tiers.shape != shape:
        got = getattr(tiers, "shape", type(tiers).__name__)
        raise InvariantViolation(f"{name}: tiers must be an array of shape {shape}, got {got}")
    if tiers.dtype != np.uint8:
        raise InvariantViolation(f"{name}: tiers dtype must be uint8, got {tiers.dtype}")
    if tiers.size and tiers.max() > TIER_GPU:
        raise InvariantViolation(f"{name}: tier values must be GONE/CPU/GPU (0/1/2)")


def check_gone_absorbing(name: str, before: np.ndarray, after: np.ndarray, step: int) -> None:
    """No position goes from GONE (``before``) to another tier (``after``) at ``step``."""
    if ((before == TIER_GONE) & (after != TIER_GONE)).any():
        raise InvariantViolation(
            f"{name}: a GONE position came back at step {step} (GONE is absorbing)")


def check_capacity(name: str, policy: _HasCapacity, n_gpu: int, step: int) -> None:
    """The GPU audio tokens (``n_gpu``) fit the policy's declared capacity (step -1: prefill)."""
    cap = policy.gpu_capacity()
    if cap is not None and n_gpu > cap:
        raise InvariantViolation(
            f"{name}: {n_gpu} GPU audio tokens exceed its capacity {cap} at step {step}")
