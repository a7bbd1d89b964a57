"""What WnW's head sensitivity costs per answer token (App. E, Eq. 4-5): one backward pass each.

Generates a clip's answer with the recording attention, then takes the loss gradient of
``--passes`` answer tokens spread over it; prints the CPU time of the generation and per pass
(one thread; the teacher-forced forward is shared by the passes and counted in).

Usage: python benchmarks/calibration_cost.py CLIP.flac [--model minivox] [--passes 6]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

from kvsim.tracer.audio import load_audio  # noqa: E402
from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone  # noqa: E402
from kvsim.tracer.calibrate import CalibrationConfig, key_gradients, sensitivity_steps  # noqa: E402
from kvsim.tracer.run import TraceOptions, generate_traced  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clip")
    ap.add_argument("--model", default="minivox")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bb = load_backbone(args.model, LoadOptions())
    prep = bb.prepare(load_audio(args.clip, bb.sample_rate), PromptSpec())
    t0 = time.process_time()
    gen = generate_traced(bb, prep, TraceOptions(max_new_tokens=args.max_new_tokens))
    t_gen = time.process_time() - t0
    n = len(gen.tokens)
    steps = sensitivity_steps(n, CalibrationConfig(max_tokens=args.passes))
    t0 = time.process_time()
    done = sum(1 for _ in key_gradients(bb, prep, list(gen.tokens), steps))
    per = (time.process_time() - t0) / done
    print(f"prompt {prep.n_prompt} positions, answer {n} tokens; generation {t_gen:.1f} s CPU; "
          f"{done} backward passes {per:.2f} s CPU each; the whole answer ~{per * n / 60:.1f} min CPU")


if __name__ == "__main__":
    main()
