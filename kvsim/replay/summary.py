"""The end-of-run summary of a replayed run: retention, attention quality and transfers, each
a mean over decode steps (and layers) of what the step loop accumulated."""

from __future__ import annotations

from typing import Any

import polars as pl

from kvsim.core.steplog import retention_per_step
from kvsim.replay.metrics import RunMetrics


def retention_summary(log: pl.DataFrame, audio_kv_total: int, prefill_r_gpu: float) -> dict[str, Any]:
    """r_GPU (mean, max, after prefill), r_GPU+CPU and the fraction of audio KV read, over the
    steps of a step log (WnW §3.4: denominators L * H_kv * T_a)."""
    gpu, cpu, read = retention_per_step(log, audio_kv_total, prefill_r_gpu)
    return {
        "r_gpu": float(gpu.mean()),
        "r_gpu_max": float(gpu.max()),
        "r_gpu_prefill": prefill_r_gpu,
        "r_gpu_cpu": float((gpu + cpu).mean()),
        "read_fraction": float(read.mean()),
    }


def quality_summary(metrics: RunMetrics, n_steps: int, n_layers: int) -> dict[str, float]:
    """Attention recall (mean, worst step), top-K Jaccard and output error, means over the
    (step, layer) pairs (output error: over the sampled ones; NaN if none)."""
    n = max(n_steps, 1)
    return {
        "attn_recall": float(metrics.step_recall.sum() / (n * n_layers)),
        "attn_recall_min_step": float((metrics.step_recall / n_layers).min()) if n_steps else 1.0,
        "topk_jaccard": float(metrics.step_jaccard.sum() / (n * n_layers)),
        "output_error": metrics.err_sum / metrics.err_n if metrics.err_n else float("nan"),
    }


def transfer_summary(log: pl.DataFrame) -> dict[str, float]:
    """CPU→GPU megabytes and contiguous transfers per step."""
    return {
        "h2d_mb_per_step": float(log["h2d_bytes"].mean() / 1e6) if log.height else 0.0,
        "transfers_per_step": float(log["h2d_transfers"].mean()) if log.height else 0.0,
    }
