"""How well a subsample of answer tokens estimates WnW App. E's head sensitivity.

App. E averages the loss gradient of every answer token (Eq. 5); each token costs one backward
pass through the whole prompt, so ``kvsim calibrate --max-tokens N`` takes N tokens spread over
the answer (``--token-sample even``) or its first N (``first``). This script computes, on the
same clips, the per-token sensitivities of every answer token once and compares the whole
answer's mean with the subsample estimates: rank correlation over the KV-heads, relative error,
and how many of the top heads by VS × HS (WnW's triage order) each estimate keeps.

Usage: python scripts/calibration_token_sample.py CLIP.flac [...] --heads heads.json
       [--model minivox] [--tokens 16] [--max-new-tokens 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from kvsim.trace.heads import read_heads
from kvsim.tracer.audio import load_audio
from kvsim.tracer.backbones import LoadOptions, PromptSpec, load_backbone
from kvsim.tracer.calibrate import (
    CalibrationConfig,
    key_gradients,
    sensitivity_steps,
    token_sensitivity,
)
from kvsim.tracer.run import TraceOptions, generate_traced


def per_token_sensitivity(bb, audio: Path, max_new_tokens: int) -> np.ndarray:
    """(T, L, H_kv): mean over audio positions of ||dL_t/dK|| for every answer token t."""
    prep = bb.prepare(load_audio(audio, bb.sample_rate), PromptSpec())
    gen = generate_traced(bb, prep, TraceOptions(max_new_tokens=max_new_tokens))
    rows = [token_sensitivity(grads) for _, grads in key_gradients(bb, prep, list(gen.tokens))]
    return np.stack(rows)


def top_overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Share of the top-k entries of ``a`` that are among the top-k of ``b``."""
    ta, tb = set(np.argsort(-a.ravel())[:k]), set(np.argsort(-b.ravel())[:k])
    return len(ta & tb) / k


def compare(per_clip: list[np.ndarray], vs: np.ndarray, n_tokens: int, top: int) -> dict:
    whole = np.mean([t.mean(axis=0) for t in per_clip], axis=0)
    out = {}
    for sample in ("even", "first"):
        cfg = CalibrationConfig(max_tokens=n_tokens, token_sample=sample)
        est = np.mean([t[sensitivity_steps(len(t), cfg)].mean(axis=0) for t in per_clip], axis=0)
        out[f"{sample} {n_tokens}"] = {
            "spearman_hs": float(spearmanr(whole.ravel(), est.ravel())[0]),
            "median_rel_error": float(np.median(np.abs(est - whole) / whole)),
            f"top{top}_hs": top_overlap(whole, est, top),
            f"top{top}_vs_x_hs": top_overlap(vs * whole, vs * est, top),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("clips", nargs="+", type=Path)
    ap.add_argument("--heads", type=Path, required=True, help="heads.json whose VS orders the triage")
    ap.add_argument("--model", default="minivox")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=36, help="top heads compared (36 = WnW's n_voice on minivox at r = 0.2)")
    ap.add_argument("--max-new-tokens", type=int, default=300)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--save", type=Path, help="also save the per-token sensitivities (npz, one array per clip)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bb = load_backbone(args.model, LoadOptions())
    t0 = time.perf_counter()
    per_clip = []
    for clip in args.clips:
        per_clip.append(per_token_sensitivity(bb, clip, args.max_new_tokens))
        print(f"{clip.name}: {len(per_clip[-1])} answer tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    if args.save:
        np.savez(args.save, **{c.stem: t for c, t in zip(args.clips, per_clip, strict=True)})
    res = compare(per_clip, read_heads(args.heads).voice_score, args.tokens, args.top)
    print(f"\n{len(per_clip)} clips, {sum(map(len, per_clip))} answer tokens: each estimate against "
          "the whole answers' mean")
    print("| estimate | Spearman (HS, all heads) | median relative error | "
          f"top-{args.top} HS kept | top-{args.top} VS×HS kept |\n|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['spearman_hs']:.3f} | {r['median_rel_error']:.3f} | "
              f"{r[f'top{args.top}_hs']:.2f} | {r[f'top{args.top}_vs_x_hs']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"clips": [str(c) for c in args.clips], "results": res,
                                         "tokens": [len(t) for t in per_clip]}, indent=1))


if __name__ == "__main__":
    main()
