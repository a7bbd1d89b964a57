"""A policy at a budget with hyperparameters: what a replay or live run is asked to run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvsim.policies import registry
from kvsim.policies.base import Policy


@dataclass(frozen=True)
class PolicySpec:
    """One policy at one budget with hyperparameters.

    ``source`` is ``package.module:ClassName`` for a user's policy outside kvsim: :meth:`make`
    imports and registers it first, so a spec also works in a fresh worker process.
    """

    name: str
    budget: float
    params: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        inner = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}({inner})"

    def make(self) -> Policy:
        if self.source is not None:
            registry.load(self.source)
        return registry.make(self.name, self.budget, **self.params)
