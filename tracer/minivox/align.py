"""Stage-1 projector alignment from word timings (cheap: no LLM forward).

Each audio token k covers ``[k/12.5, (k+1)/12.5)`` s. With the exact espeak word onsets we
know which word starts inside each audio token; the projector is regressed so that the audio
token holding a word's onset maps onto the SmolLM2 input embedding of that word's first BPE
token (and the following audio tokens onto its next BPE tokens), while audio tokens without an
onset map to the zero vector. This gives the frozen decoder a "sparse soft transcript" to copy
from, so the end-to-end stage (``train.py --init-projector``) starts from a projector that
already carries the words, instead of from noise.

Usage::

    python -m tracer.minivox.align --data /work/data/minivox --out /work/data/minivox/align.safetensors
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .data import read_manifest

FRAMES_PER_TOKEN = 4
TOKENS_PER_S = 12.5


def word_targets(words: list[str], starts: list[float], n_tokens: int, tok) -> tuple[
        np.ndarray, np.ndarray]:
    """(token id or -1) per audio token: the BPE tokens of each word from its onset token on."""
    ids = np.full(n_tokens, -1, dtype=np.int64)
    for i, (w, s) in enumerate(zip(words, starts, strict=True)):
        pieces = tok((" " if i else "") + w, add_special_tokens=False)["input_ids"]
        k = int(math.floor(s * TOKENS_PER_S))
        while k < n_tokens and ids[k] != -1:
            k += 1
        for p in pieces:
            if k >= n_tokens:
                break
            ids[k] = p
            k += 1
    return ids, (ids >= 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="stage-1 projector alignment from word timings")
    ap.add_argument("--data", type=Path, default=Path("/work/data/minivox"))
    ap.add_argument("--out", type=Path, default=Path("/work/data/minivox/align.safetensors"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--clips-per-step", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--onset-weight", type=float, default=4.0)
    ap.add_argument("--max-minutes", type=float, default=12.0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)

    from transformers import AutoTokenizer

    base = _untrained_dir()
    tok = AutoTokenizer.from_pretrained(str(base))
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        key = next(k for k in f.keys() if k.endswith("embed_tokens.weight"))  # noqa: SIM118
        emb = f.get_tensor(key).float()

    rows = read_manifest(a.data, "train").to_dicts() + read_manifest(a.data, "train_long").to_dicts()
    cache = a.data / "enc_cache"
    X, T, W = [], [], []
    for r in tqdm(rows, desc="load", mininterval=10):
        f = cache / f"{r['id']}.npy"
        if not f.is_file():
            continue
        h = np.load(f)  # (n_chunks*1500, 384) fp16
        x = h.reshape(-1, 384 * FRAMES_PER_TOKEN)
        ids, on = word_targets(r["words"], r["word_start"], x.shape[0], tok)
        X.append(x)
        T.append(ids)
        W.append(on)
    X = torch.from_numpy(np.concatenate(X))
    T = torch.from_numpy(np.concatenate(T))
    print(f"{X.shape[0]} audio tokens, {int((T >= 0).sum())} with a word token", flush=True)

    from torch import nn

    proj = nn.Sequential(nn.Linear(1536, 576, bias=False), nn.GELU(), nn.Linear(576, 576, bias=False))
    for m in proj:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    opt = torch.optim.AdamW(proj.parameters(), lr=a.lr, weight_decay=0.01)
    n = X.shape[0]
    bs = 375 * a.clips_per_step
    steps = a.epochs * (n // bs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(a.seed)
    t0 = time.time()
    step = 0
    bar = tqdm(total=steps, desc="align", mininterval=10)
    done = False
    for _ep in range(a.epochs):
        perm = torch.randperm(n, generator=g)
        for i in range(n // bs):
            idx = perm[i * bs : (i + 1) * bs]
            x = X[idx].float()
            t = T[idx]
            on = t >= 0
            target = torch.zeros(len(idx), 576)
            target[on] = emb[t[on]]
            w = torch.where(on, a.onset_weight, 1.0).unsqueeze(-1)
            y = proj(x)
            loss = ((y - target) ** 2 * w).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            if step % 50 == 0:
                with torch.no_grad():
                    if on.any():
                        yn = nn.functional.normalize(y[on], dim=-1)
                        en = nn.functional.normalize(emb, dim=-1)
                        acc = ((yn @ en.T).argmax(-1) == t[on]).float().mean().item()
                    else:
                        acc = float("nan")
                bar.set_postfix(loss=f"{loss.item():.4f}", onset_acc=f"{acc:.3f}")
            if (time.time() - t0) / 60 > a.max_minutes:
                done = True
                break
        if done:
            break
    bar.close()
    sd = {"linear_1.weight": proj[0].weight.detach().contiguous(),
          "linear_2.weight": proj[2].weight.detach().contiguous()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(a.out), metadata={"format": "minivox-projector-init", "steps": str(step)})
    print(f"wrote {a.out} after {step} steps ({time.time() - t0:.0f} s)")


def _untrained_dir() -> Path:
    from .build import ensure_cached

    return ensure_cached(adapter=None, untrained=True)


if __name__ == "__main__":
    main()
