"""Traced / plain generation time on the same input (target <= 1.25 on CPU for tiny backbones).

Plain: the checkpoint loaded with stock sdpa attention, ``model.generate`` greedy.
Traced: the checkpoint loaded with the recording attention on the text decoder, greedy
``generate`` with the recorder active, plus stacking the recorded tensors on the CPU.
Both decode the same tokens (checked). Reports the median of ``--repeats`` runs each,
interleaved.

    python benchmarks/trace_overhead.py                       # tiny Voxtral + Qwen-Omni
    python benchmarks/trace_overhead.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the test fixtures (tiny checkpoints) from the source tree; kvsim itself from the install
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvsim.tracer.audio import load_audio  # noqa: E402
from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone  # noqa: E402
from kvsim.tracer.run import TraceOptions, generate_traced, greedy_kwargs  # noqa: E402


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model: str, wav: Path, device: str, dtype: str, new_tokens: int,
            repeats: int) -> dict:
    plain = load_backbone(model, LoadOptions(device=device, dtype=dtype, trace_attention=False))
    traced = load_backbone(model, LoadOptions(device=device, dtype=dtype))
    clip = load_audio(wav, plain.sample_rate)
    p_plain = plain.prepare(clip, PromptSpec())
    p_traced = traced.prepare(clip, PromptSpec())
    kw = greedy_kwargs(new_tokens)
    kw["min_new_tokens"] = new_tokens  # same length for both, whatever the random weights say
    opts = TraceOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    t_plain, t_traced = [], []
    tok_plain = tok_traced = None
    for i in range(repeats + 1):  # first round is warm-up
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = plain.model.generate(**p_plain.inputs, **kw)
        _sync(device)
        t1 = time.perf_counter()
        tok_plain = out[0, p_plain.n_prompt:].tolist()
        gen = generate_traced(traced, p_traced, opts)
        _sync(device)
        t2 = time.perf_counter()
        tok_traced = gen.tokens
        if i:
            t_plain.append(t1 - t0)
            t_traced.append(t2 - t1)
    return {"model": model, "prompt": p_plain.n_prompt, "new_tokens": len(tok_plain),
            "identical": tok_plain == tok_traced,
            "plain_s": statistics.median(t_plain), "traced_s": statistics.median(t_traced),
            "ratio": statistics.median(t_traced) / statistics.median(t_plain)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="checkpoint dir or name (repeatable); "
                                                     "default: tiny Voxtral and Qwen-Omni")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seconds", type=float, default=10.0, help="audio length")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    tmp = Path(tempfile.mkdtemp(prefix="kvsim-overhead-"))
    from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

    models = args.model or [str(tiny_checkpoint(k, tmp)) for k in ("voxtral", "qwen-omni")]
    wav = write_tone(tmp / "clip.wav", args.seconds)
    worst = 0.0
    print(f"{'model':<28} {'prompt':>6} {'new':>4} {'plain s':>9} {'traced s':>9} "
          f"{'ratio':>6}  identical")
    for m in models:
        r = measure(m, wav, args.device, args.dtype, args.new_tokens, args.repeats)
        worst = max(worst, r["ratio"])
        print(f"{Path(r['model']).name:<28} {r['prompt']:>6} {r['new_tokens']:>4} "
              f"{r['plain_s']:>9.4f} {r['traced_s']:>9.4f} {r['ratio']:>6.3f}  {r['identical']}")
    print(f"worst traced/plain ratio: {worst:.3f} (target <= 1.25)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
