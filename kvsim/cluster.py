"""Joining a Ray cluster: the one start-up path of every ``--ray`` option (replay, live,
studies)."""

from __future__ import annotations

from typing import Any

RAY_MISSING = "--ray needs Ray: pip install 'kvsim[ray]'"


def connect(address: str) -> Any:
    """The ``ray`` module, initialised once per process: ``local`` starts a local Ray,
    ``auto`` joins the cluster ``ray start`` made, anything else is a cluster address.

    Raises
    ------
    ValueError
        One line: Ray is not installed, or the cluster cannot be reached.
    """
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    if not ray.is_initialized():
        try:
            ray.init(address=None if address == "local" else address, include_dashboard=False,
                     log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"--ray {address}: {first}") from None
    return ray
