"""Peak memory of ``kvsim synth`` and ``kvsim replay`` against audio length.

For every length it synthesises a trace (``kvsim synth --preset PRESET --no-values``), then
replays ``full,snapkv,wnw,arkvale`` at r_GPU = 0.2 over its first ``--max-steps`` decode steps
(memory does not grow with the steps replayed; time does). Each command runs in a process of
its own, whose peak resident set (``ru_maxrss`` of that child, from ``os.wait4``) is the
figure; it includes the memory-mapped trace pages the process touched. The target is
``peak <= 2.5 x key bytes + 0.5 GB``, key bytes being the trace's stored keys
(L x H_kv x N x D x storage bytes).

    python benchmarks/memory_scaling.py --minutes 1 4 10 [--preset voxtral-mini]
        [--max-steps 4] [--workdir DIR] [--keep] [--streamed-synth] [--json OUT]

Memory figures do not depend on machine load; wall times do (quote them from a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPLAY_POLICIES = "full,snapkv,wnw,arkvale"
REPLAY_BUDGET = "0.2"
BOUND_FACTOR = 2.5
BOUND_SLACK_BYTES = 0.5e9


#: ``kvsim.synth.write_synthetic`` (layer by layer) with the arguments of ``kvsim synth --no-values``
STREAMED_SYNTH = (
    "import sys; from kvsim.synth import SynthConfig, write_synthetic; "
    "write_synthetic(sys.argv[1], SynthConfig(preset=sys.argv[2], audio_seconds=float(sys.argv[3]), "
    "decode_steps=int(sys.argv[4]), store_values=False))"
)


@dataclass
class Measure:
    """One command's wall time and peak resident set."""

    command: str
    minutes: float
    wall_s: float
    peak_bytes: int
    key_bytes: int

    @property
    def bound_bytes(self) -> float:
        return BOUND_FACTOR * self.key_bytes + BOUND_SLACK_BYTES

    @property
    def ok(self) -> bool:
        return self.peak_bytes <= self.bound_bytes


def run_measured(argv: list[str]) -> tuple[float, int]:
    """Run ``argv`` in a child process; its wall time (s) and peak RSS (bytes)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024  # Linux: kilobytes


def key_bytes(trace: Path) -> int:
    """Bytes of the keys stored in ``trace`` (from its meta.json)."""
    model = json.loads((trace / "meta.json").read_text())
    m, n = model["model"], model["n_positions"]
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[m.get("dtype", "float16")]
    return m["n_layers"] * m["n_kv_heads"] * n * m["head_dim"] * itemsize


def measure_length(minutes: float, args: argparse.Namespace, workdir: Path) -> list[Measure]:
    """Synthesise then replay a trace of ``minutes`` of audio."""
    kvsim = [sys.executable, "-m", "kvsim"]
    trace = workdir / f"{args.preset}-{minutes:g}min.kvtrace"
    if args.streamed_synth:
        wall, peak = run_measured([sys.executable, "-c", STREAMED_SYNTH, str(trace), args.preset,
                                   str(60 * minutes), str(args.decode_steps)])
    else:
        wall, peak = run_measured(kvsim + ["synth", str(trace), "--preset", args.preset,
                                           "--audio-seconds", str(60 * minutes),
                                           "--decode-steps", str(args.decode_steps), "--no-values"])
    keys = key_bytes(trace)
    out = [Measure("synth-streamed" if args.streamed_synth else "synth", minutes, wall, peak, keys)]
    wall, peak = run_measured(kvsim + ["replay", str(trace), "-p", REPLAY_POLICIES,
                                       "-b", REPLAY_BUDGET, "--max-steps", str(args.max_steps),
                                       "-o", str(workdir / f"replay-{minutes:g}min")])
    out.append(Measure("replay", minutes, wall, peak, keys))
    if not args.keep:
        shutil.rmtree(trace)
    return out


def report(m: Measure) -> str:
    gb = 1e9
    return (f"{m.command:14s} {m.minutes:6g} min  wall {m.wall_s:7.1f} s  "
            f"peak {m.peak_bytes / gb:6.2f} GB  keys {m.key_bytes / gb:6.3f} GB  "
            f"peak/keys {m.peak_bytes / m.key_bytes:5.2f}  "
            f"bound {m.bound_bytes / gb:6.2f} GB  {'pass' if m.ok else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, nargs="+", default=[1.0, 4.0, 10.0])
    ap.add_argument("--preset", default="voxtral-mini")
    ap.add_argument("--decode-steps", type=int, default=120)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where traces and replay outputs go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the synthesised traces")
    ap.add_argument("--streamed-synth", action="store_true",
                    help="synthesise with kvsim.synth.write_synthetic (a layer at a time) "
                         "instead of the kvsim synth command")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if any(m <= 0 for m in args.minutes):
        sys.exit("--minutes: every length must be > 0")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvsim-memory-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[Measure] = []
    try:
        for minutes in args.minutes:
            for m in measure_length(minutes, args, workdir):
                print(report(m), flush=True)
                results.append(m)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(m), "bound_bytes": m.bound_bytes, "ok": m.ok}
                                         for m in results], indent=1) + "\n")
    if not all(m.ok for m in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
