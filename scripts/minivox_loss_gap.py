"""Teacher-forced transcript loss of minivox adapters on seen training clips vs held-out clips.

Usage::

    python scripts/minivox_loss_gap.py ADAPTER.safetensors [ADAPTER ...] [--data DIR]

For each adapter prints the mean cross-entropy (nats per transcript token, ``<|im_end|>``
included) on 16 short training clips from the first 40 steps of the stage-2 schedule (seen by
every checkpoint of the shipped run), the first 16 dev clips and the first 8 test_30_60 clips.
A training loss that keeps falling while the held-out loss does not is memorisation of the
training texts, not better listening.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvsim.minivox import load_minivox, minivox_dir
from kvsim.minivox.data import read_manifest
from kvsim.minivox.train import TrainConfig, batch_rows, encoder_cache_dir, loss_fn, make_batch


def seen_training_clips(data: Path, n: int = 16) -> list[dict]:
    """Short clips of the first 40 steps of the shipped run's schedule (seed 0, batch 4)."""
    train = read_manifest(data, "train").to_dicts()
    long = read_manifest(data, "train_long").to_dicts()
    cfg = TrainConfig(seed=0, batch=4, p_concat=0.12, concat_max=4)
    rows: list[dict] = []
    for step in range(40):
        batch = batch_rows(step, cfg, train, long)
        if len(batch) == cfg.batch:  # a batch of short clips
            rows += batch
    return rows[:n]


@torch.no_grad()
def transcript_loss(model, proc, rows: list[dict], cache: Path) -> tuple[float, int]:
    """Token-weighted mean transcript loss over ``rows`` (one clip per forward) and the count."""
    total, tokens = 0.0, 0
    for row in rows:
        batch = make_batch(model, proc, [row], cache)
        n = int((batch.labels != -100).sum())
        total += float(loss_fn(model, batch)[0]) * n
        tokens += n
    return total / tokens, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("adapters", nargs="+", type=Path)
    ap.add_argument("--data", type=Path, default=Path("data/minivox"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    sets = {
        "train (seen)": seen_training_clips(args.data),
        "dev": read_manifest(args.data, "dev").to_dicts()[:16],
        "test_30_60": read_manifest(args.data, "test_30_60").to_dicts()[:8],
    }
    for adapter in args.adapters:
        model, proc = load_minivox(minivox_dir(adapter))
        model.eval()
        cache = encoder_cache_dir(args.data, model.config.whisper_encoder)
        for name, rows in sets.items():
            loss, tokens = transcript_loss(model, proc, rows, cache)
            print(f"{adapter}\t{name}\t{len(rows)} clips\t{tokens} tokens\tloss {loss:.3f}", flush=True)


if __name__ == "__main__":
    main()
