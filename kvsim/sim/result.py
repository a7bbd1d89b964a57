"""Simulation results: per-step table and summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from kvsim.sim.engine import RawResult, SimMode

MB = 1e6  # MB/step is decimal megabytes (WnW Table 4 unit assumed decimal)


@dataclass
class SimResult:
    """What :func:`kvsim.sim.simulate_run` returns.

    ``per_step`` columns: ``step``, ``ms`` (step wall time = ms/token for batch 1),
    ``host_copy_ms`` (host time issuing or blocked on copies), ``compute_stall_ms`` (compute
    stream idle waiting on a copy event), ``transfer_ms`` (their sum), ``gpu_bytes`` (HBM
    ledger peak during the step: weights + KV + staging + workspace), ``h2d_bytes``,
    ``h2d_copies``, ``cpu_bytes`` (host memory of KV held only on CPU).
    """

    raw: RawResult
    gpu: str
    model: str
    runtime: str
    mode: SimMode
    batch: int
    sim_wall_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def per_step(self) -> pl.DataFrame:
        r = self.raw
        transfer = r.host_copy_us + r.compute_stall_us
        return pl.DataFrame(
            {
                "step": np.arange(len(r.step_us), dtype=np.int64),
                "ms": r.step_us / 1e3,
                "host_copy_ms": r.host_copy_us / 1e3,
                "compute_stall_ms": r.compute_stall_us / 1e3,
                "transfer_ms": transfer / 1e3,
                "gpu_bytes": r.gpu_bytes,
                "h2d_bytes": r.h2d_bytes,
                "h2d_copies": r.n_copies,
                "cpu_bytes": r.cpu_bytes,
            }
        )

    def summary(self) -> dict[str, Any]:
        """ms/token (mean, median), tokens/s, peak GPU bytes, CPU->GPU MB/step, transfer share."""
        r = self.raw
        total = float(r.step_us.sum())
        transfer = float((r.host_copy_us + r.compute_stall_us).sum())
        mean_ms = float(r.step_us.mean() / 1e3)
        return {
            "gpu": self.gpu,
            "model": self.model,
            "runtime": self.runtime,
            "mode": _mode_name(self.mode),
            "batch": self.batch,
            "steps": int(len(r.step_us)),
            "ms_per_token_mean": mean_ms,
            "ms_per_token_median": float(np.median(r.step_us) / 1e3),
            "tokens_per_s": self.batch * 1e3 / mean_ms if mean_ms else 0.0,
            "peak_gpu_bytes": int(r.high_water),
            "peak_gpu_gib": r.high_water / 2**30,
            "h2d_mb_per_step": float(r.h2d_bytes.mean() / MB),
            "h2d_copies_per_step": float(r.n_copies.mean()),
            "peak_cpu_bytes": int(r.cpu_bytes.max()) if len(r.cpu_bytes) else 0,
            "transfer_wait_share": min(1.0, transfer / total) if total else 0.0,
            "sim_events": r.events,
            "sim_wall_s": self.sim_wall_s,
        }


def _mode_name(mode: SimMode) -> str:
    parts = [
        f"recall={mode.recall}", f"granularity={mode.granularity}",
        f"pinned={str(mode.pinned).lower()}",
    ]
    if mode.cuda_graphs:
        parts.append("cuda_graphs=true")
    if mode.recall_timing != "auto":
        parts.append(f"recall_timing={mode.recall_timing}")
    return ",".join(parts)
