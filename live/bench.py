"""Latency and memory of live decoding on a random-weight backbone of a chosen shape.

``python -m kvsim.live.bench --device cuda --layers 30 --q-heads 9 --kv-heads 3 --head-dim 64
--seconds 120 --policies full,wnw,snapkv,arkvale --budget 0.2 --steps 64`` prints one JSON line
per (policy, path) with ms/token, device audio KV MB, H2D MB/step and (CUDA) peak memory. The
weights are random (the decoder shape is what costs time); greedy outputs are meaningless, so
decoding is forced to run ``--steps`` steps (EOS ignored).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvsim.core.shapes import HeadScores
from kvsim.live.decode import LiveConfig, live_generate
from kvsim.live.models import TinyBackbone, TinyConfig
from kvsim.policies.spec import PolicySpec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--policies", default="full,wnw")
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--paths", default="mask,physical")
    ap.add_argument("--select", choices=("auto", "device", "host"), default="auto",
                    help="where query-aware policies select: LiveConfig.device_select "
                         "(auto: on the device unless it is the CPU)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = TinyConfig(n_layers=a.layers, n_q_heads=a.q_heads, n_kv_heads=a.kv_heads,
                     head_dim=a.head_dim, vocab=a.vocab)
    lm = TinyBackbone(cfg, device=a.device)
    lm.model.to(getattr(torch, a.dtype))
    lm.model.generation_config.eos_token_id = None  # run exactly --steps steps
    rng = np.random.default_rng(0)
    prompt = lm.prepare((0.1 * rng.standard_normal(int(16000 * a.seconds))).astype(np.float32))
    prompt.model_inputs["inputs_embeds"] = prompt.model_inputs["inputs_embeds"].to(getattr(torch, a.dtype))
    scores = HeadScores(rng.random((a.layers, a.kv_heads)), rng.random((a.layers, a.kv_heads)), "random")
    # plain greedy generate (no session): per-token time from two lengths, prefill cancels
    from kvsim.live.decode import plain_generate

    plain_generate(lm, prompt, 2)
    t = []
    for n in (1, a.steps + 1):
        t0 = time.perf_counter()
        plain_generate(lm, prompt, n)
        t.append(time.perf_counter() - t0)
    print(json.dumps({"policy": "plain-generate", "path": "stock", "device": a.device, "dtype": a.dtype,
                      "n_audio": prompt.n_audio, "steps": a.steps,
                      "ms_per_token": round(1e3 * (t[1] - t[0]) / a.steps, 3)}), flush=True)
    for name in a.policies.split(","):
        for path in a.paths.split(","):
            budget = 1.0 if name == "full" else a.budget
            lc = LiveConfig(max_new_tokens=a.steps + 1, physical=path == "physical", head_scores=scores,
                            device_select={"auto": None, "device": True, "host": False}[a.select])
            live_generate(lm, prompt, PolicySpec(name, budget), LiveConfig(max_new_tokens=3, physical=lc.physical,
                                                                           head_scores=scores))  # warm-up
            t0 = time.perf_counter()
            run = live_generate(lm, prompt, PolicySpec(name, budget), lc)
            s = run.summary
            print(json.dumps({
                "policy": name, "budget": budget, "path": path, "device": a.device, "dtype": a.dtype,
                "n_audio": prompt.n_audio, "steps": s["steps"], "ms_per_token": round(s["ms_per_token"], 3),
                "r_gpu": round(s["r_gpu"], 4), "h2d_mb_per_step": round(s["h2d_mb_per_step"], 4),
                "device_audio_mb": round(s.get("device_audio_mb", float("nan")), 3),
                "physical_h2d_mb_per_step": round(s.get("physical_h2d_mb_per_step", float("nan")), 4),
                "peak_mem_mb": round(s.get("peak_mem_mb", float("nan")), 1),
                "after_prefill_mb": round(s.get("after_prefill_mb", float("nan")), 1),
                "prefill_peak_mb": round(s.get("prefill_peak_mb", float("nan")), 1),
                "policy_seconds": round(s["policy_seconds"], 3), "wall_s": round(time.perf_counter() - t0, 2),
            }), flush=True)


if __name__ == "__main__":
    main()
