"""The shared setup of the live benchmarks: their options and one minivox clip, prefilled once."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from kvsim.live.data import from_manifest  # noqa: E402
from kvsim.live.decode import prefill_once  # noqa: E402
from kvsim.live.models import load_backbone  # noqa: E402

HEADS = Path(__file__).resolve().parent.parent / "minivox" / "heads.json"


def clip_options(split: str, clip: int, tokens: int, rounds: int) -> argparse.ArgumentParser:
    """``--data --split --clip --tokens --rounds --budget`` with these defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("/work/data/minivox"))
    ap.add_argument("--split", default=split)
    ap.add_argument("--clip", type=int, default=clip)
    ap.add_argument("--tokens", type=int, default=tokens, help="new tokens per run")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--budget", type=float, default=0.2)
    return ap


def prefilled_clip(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """minivox (one torch thread), the clip of ``args``, its prompt and its shared prefill."""
    torch.set_num_threads(1)
    lm = load_backbone("minivox")
    item = from_manifest(args.data / "manifest.parquet", args.split)[args.clip]
    audio, _ = item.load()
    prompt = lm.prepare(audio)
    return lm, item, prompt, prefill_once(lm, prompt)
