"""What differs between the transformers versions kvsim supports (``>=5.20,<6``)."""

from __future__ import annotations

import inspect
from typing import Any


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` (a ``transformers.Cache``) to ``module``'s forward:
    ``cache`` where the forward takes it (transformers 5.25 on; ``past_key_values`` is
    deprecated there), ``past_key_values`` before."""
    params = inspect.signature(module.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}
