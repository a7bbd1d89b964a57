"""What differs between the transformers versions kvsim supports (``>=5.20,<6``)."""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(module: Any) -> str:
    """The keyword that hands a ``transformers.Cache`` to ``module``'s forward: ``cache`` where
    the forward takes it (transformers 5.25 on; ``past_key_values`` is deprecated there),
    ``past_key_values`` before. Look it up once, outside a decoding loop."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
