"""Tiers: where one audio KV position of one (layer, KV-head) lives (the policy protocol's
state, shared by replay, live decoding and the policies)."""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Tier(IntEnum):
    """Where one audio KV position of one (layer, KV-head) lives."""

    GONE = 0  #: discarded; absorbing
    CPU = 1  #: a recallable copy on host memory only
    GPU = 2  #: resident on the accelerator (it may also have a host copy)


TIER_DTYPE = np.uint8
