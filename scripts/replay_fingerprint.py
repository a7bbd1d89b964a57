"""SHA-256 fingerprints of replay and simulator results, to show a refactor changes nothing.

Replays every registered policy at budgets 0.2, 0.4, 0.6, 0.8 over the shipped traces with the
output error on every step, and simulates a sample of those runs (every recall mode, batch 1
and 4) plus analytic workloads that recall every step. Every summary value (but the wall-clock
``policy_seconds``), every step-log column, the per-head recall, the tiers of a recorded run and
every simulator array are hashed bit for bit. Run it before and after a change on the same
machine: equal hashes mean identical results.

Usage: python scripts/replay_fingerprint.py [--out fingerprint.json] [--max-steps N]
(from the repository root; about a minute on one core)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from kvsim.policies import registry  # noqa: E402
from kvsim.replay.engine import PolicySpec, ReplayConfig, Replayer  # noqa: E402
from kvsim.sim import (  # noqa: E402
    AnalyticPolicy,
    analytic_workload,
    model_preset,
    simulate_run,
    simulate_workload,
)
from kvsim.trace.reader import Trace, find_traces  # noqa: E402

BUDGETS = (0.2, 0.4, 0.6, 0.8)
SIM_MODES = ("sync", "overlap", "coalesced", "sync-run", "overlap-run+graphs")
SIM_BUDGET = 0.4  # the replayed runs fed to the simulator
_WALL_CLOCK = {"policy_seconds"}


def _hash(*parts: object) -> str:
    """SHA-256 of arrays (dtype, shape and bytes) and of other values (their repr)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"{part.dtype}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        else:
            h.update(repr(part).encode())
        h.update(b"|")
    return h.hexdigest()


def _frame_hash(frame: pl.DataFrame) -> str:
    """Every column of a frame, list columns flattened with their lengths."""
    parts: list[object] = [frame.columns, [str(t) for t in frame.dtypes]]
    for name in frame.columns:
        col = frame[name]
        if isinstance(col.dtype, pl.List):
            parts += [col.list.len().to_numpy(), col.explode().to_numpy()]
        else:
            parts.append(col.to_numpy())
    return _hash(*parts)


def _run_hashes(result) -> dict[str, str]:
    summary = {k: v for k, v in result.summary.items() if k not in _WALL_CLOCK}
    out = {
        "summary": _hash(sorted(summary.items())),
        "step_log": _frame_hash(result.step_log),
        "per_head_recall": _hash(result.per_head_recall),
        "facts": _hash(result.facts.to_json()),
    }
    if result.tiers is not None:
        out["tiers"] = _hash(*result.tiers)
    return out


def replay_fingerprints(paths: list[Path], max_steps: int | None,
                        block_mib: float = ReplayConfig.attention_block_mib) -> tuple[dict, list]:
    """Hashes of every run of every trace; also returns the results at ``SIM_BUDGET``."""
    specs = [PolicySpec(name, b) for b in BUDGETS for name in registry.available()]
    hashes: dict[str, object] = {}
    sampled = []
    for path in paths:
        trace = Trace(path)
        rep = Replayer(trace, ReplayConfig(error_stride=1, max_steps=max_steps,
                                              attention_block_mib=block_mib))
        for res in rep.run(specs):
            hashes[f"{trace.name}/{res.spec.label}@{res.spec.budget:g}"] = _run_hashes(res)
            if res.spec.budget == SIM_BUDGET:
                sampled.append(res)
        hashes[f"{trace.name}/failures"] = [f"{s.label}@{s.budget:g}: {m}" for s, m in rep.failures]
        # a recorded run (tiers after prefill and every step) of a recalling policy
        rec = Replayer(trace, ReplayConfig(error_stride=3, record_tiers=True, topk=7,
                                           max_steps=max_steps, attention_block_mib=block_mib))
        for res in rec.run([PolicySpec("wnw", 0.3), PolicySpec("arkvale", 0.3)]):
            hashes[f"{trace.name}/recorded/{res.spec.label}"] = _run_hashes(res)
    return hashes, sampled


def _raw_hash(raw) -> str:
    return _hash(raw.step_us, raw.host_copy_us, raw.compute_stall_us, raw.gpu_bytes,
                 raw.h2d_bytes, raw.n_copies, raw.cpu_bytes, raw.high_water, raw.events,
                 sorted(raw.ledger_by_tag.items()))


def sim_fingerprints(results: list) -> dict[str, str]:
    """Hashes of simulated replays and of analytic workloads that recall at every step."""
    hashes: dict[str, str] = {}
    for res in results:
        for mode in SIM_MODES:
            for batch in (1, 4):
                key = f"{res.trace}/{res.spec.label}@{res.spec.budget:g}/{mode}/b{batch}"
                try:
                    sim = simulate_run(res.step_log, res.facts, "h100-sxm", mode, batch=batch)
                except (KeyError, ValueError) as exc:  # no preset for this model
                    hashes[key] = f"error: {exc}"
                    continue
                hashes[key] = _raw_hash(sim.raw)
    model = model_preset("qwen2.5-omni-3b")
    for pol in (AnalyticPolicy("wnw", 0.2, tidal_heads=40, churn_segments_per_step=0.3),
                AnalyticPolicy("snapkv", 0.4)):
        wl = analytic_workload(model, pol, 60.0, n_decode=120)
        for mode in SIM_MODES + ("recall=sync,granularity=layer,recall_timing=in_layer",):
            for gpu in ("a100-80gb", "h200"):
                sim = simulate_workload(wl, gpu, mode, model=model, batch=3)
                hashes[f"analytic/{pol.policy}/{mode}/{gpu}"] = _raw_hash(sim.raw)
    return hashes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=Path, default=[Path("traces")])
    ap.add_argument("--out", type=Path, default=None, help="write every hash to this JSON file")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--attention-block-mib", type=float, default=ReplayConfig.attention_block_mib,
                    help="ReplayConfig.attention_block_mib (0: one step and layer at a time)")
    args = ap.parse_args()
    replay, sampled = replay_fingerprints(find_traces(args.traces), args.max_steps,
                                          args.attention_block_mib)
    sim = sim_fingerprints(sampled)
    total = {"replay": _hash(json.dumps(replay, sort_keys=True)),
             "sim": _hash(json.dumps(sim, sort_keys=True))}
    print(f"replay runs hashed: {len(replay)}  sha256 {total['replay']}")
    print(f"simulations hashed: {len(sim)}  sha256 {total['sim']}")
    if args.out:
        args.out.write_text(json.dumps({"total": total, "replay": replay, "sim": sim},
                                       indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
