"""KV-cache policies: decision logic only, one file per policy.

This package must not import ``kvsim`` or ``tracer``: the same policy object is driven by the
replay engine and by live decoding.
"""

from kvsim.policies.base import (
    TIER_CPU,
    TIER_GONE,
    TIER_GPU,
    HeadLayout,
    HeadScores,
    MissingCalibrationError,
    Policy,
    PolicyContext,
    PolicyNotApplicable,
    PrefillView,
    QueryView,
    StepView,
    Tier,
)
from kvsim.policies.registry import available, get, make, register

__all__ = [
    "TIER_CPU",
    "TIER_GONE",
    "TIER_GPU",
    "HeadLayout",
    "HeadScores",
    "MissingCalibrationError",
    "Policy",
    "PolicyContext",
    "PolicyNotApplicable",
    "PrefillView",
    "QueryView",
    "StepView",
    "Tier",
    "available",
    "get",
    "make",
    "register",
]
