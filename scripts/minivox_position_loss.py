"""Teacher-forced transcript loss of a minivox adapter by position in the transcript.

Each clip's per-token cross-entropy (nats, ``<|im_end|>`` included) is split into ``--parts``
equal runs of consecutive tokens; prints every clip's mean per part and the mean over clips.
A loss that rises towards the end of long clips would be a model losing its read position
even on the true prefix; a flat one puts the long-form errors in free-running decoding.

Usage: python scripts/minivox_position_loss.py ADAPTER.safetensors [--data DIR]
       [--split test_long] [--clips 8:16] [--parts 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvsim.minivox import load_minivox, minivox_dir
from kvsim.minivox.data import add_clip_arguments, read_manifest
from kvsim.minivox.train import encoder_cache_dir, make_batch, scored_logits


@torch.no_grad()
def token_losses(model, proc, row: dict, cache: Path) -> np.ndarray:
    """(T,) teacher-forced cross-entropy of each transcript token of one clip."""
    batch = make_batch(model, proc, [row], cache)
    return F.cross_entropy(scored_logits(model, batch).float(), batch.labels[batch.labels != -100],
                           reduction="none").numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_clip_arguments(ap)
    ap.add_argument("--parts", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, proc = load_minivox(minivox_dir(args.adapter))
    model.eval()
    means = []
    cache = encoder_cache_dir(args.data, model.config.whisper_encoder)
    for row in read_manifest(args.data, args.split).to_dicts()[args.clips]:
        ce = token_losses(model, proc, row, cache)
        means.append([part.mean() for part in np.array_split(ce, args.parts)])
        print(f"{row['id']}\t{row['duration']:.0f} s\t{ce.size} tokens\t"
              + "\t".join(f"{m:.2f}" for m in means[-1]), flush=True)
    print("mean over clips\t\t\t" + "\t".join(f"{m:.3f}" for m in np.mean(means, axis=0)))


if __name__ == "__main__":
    main()
