"""bf16 autocast against float32 on this CPU, for the matmuls of a minivox training step.

SmolLM2-360M's MLP projections (960 -> 2560 -> 960) over one stage-2 batch of 4 clips
(1,800 positions), forward and backward, on one thread: float32 and bf16 autocast run
alternately in one process, so the printed ratio compares them under the same conditions.
The trainer warns when asked for bf16 on a CPU without AMX (``kvsim.minivox.train.bf16_beats_fp32``);
this measures whether that holds here.

    python benchmarks/bf16_matmul.py [--rows 1800] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvsim.minivox.train import bf16_beats_fp32  # noqa: E402


def step_seconds(x: torch.Tensor, up: torch.nn.Linear, down: torch.nn.Linear, bf16: bool) -> float:
    """Seconds of one forward and backward pass through ``down(up(x))``."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = down(torch.nn.functional.silu(up(x))).float().square().mean()
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1800)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.rows, 960, requires_grad=True)
    up, down = torch.nn.Linear(960, 2560), torch.nn.Linear(2560, 960)
    times: dict[bool, list[float]] = {False: [], True: []}
    for bf16 in (False, True):  # warm-up
        step_seconds(x, up, down, bf16)
    for _ in range(args.repeats):
        for bf16 in (False, True):
            times[bf16].append(step_seconds(x, up, down, bf16))
    fp32, bf16 = statistics.median(times[False]), statistics.median(times[True])
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    flags = ", ".join(f"{k} {caps.get(k)}" for k in ("amx_bf16", "avx512_bf16", "avx2"))
    print(f"CPU: {caps.get('cpu_name', '?')} ({flags}); torch {torch.__version__}")
    print(f"float32 {fp32 * 1e3:.0f} ms, bf16 autocast {bf16 * 1e3:.0f} ms per forward+backward "
          f"(median of {args.repeats}): bf16 / float32 = {bf16 / fp32:.2f}")
    print(f"bf16_beats_fp32() says {bf16_beats_fp32()}; measured: {bf16 < fp32}")


if __name__ == "__main__":
    main()
