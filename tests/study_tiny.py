"""A minivox-shaped manifest of synthetic clips and a heads.json for the tiny live backbone:
the smallest input a live study runs on (tests of ``kvsim study``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import soundfile as sf

from kvsim.core.shapes import HeadScores
from kvsim.live.models import TinyConfig
from kvsim.trace.heads import write_heads


def tiny_manifest(root: Path, seconds: tuple[float, ...] = (8.0, 10.0), split: str = "test_30_60") -> Path:
    """``root/manifest.parquet`` + ``root/audio/<id>.wav`` of noise clips with a reference."""
    rng = np.random.default_rng(0)
    (root / "audio").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, s in enumerate(seconds):
        cid = f"{split}-{i:05d}"
        sf.write(str(root / "audio" / f"{cid}.wav"), (0.1 * rng.standard_normal(int(16000 * s))).astype(np.float32), 16000)
        rows.append({"id": cid, "audio_path": f"audio/{cid}.wav", "text": "some reference words here",
                     "duration": s, "split": split})
    pl.DataFrame(rows).write_parquet(root / "manifest.parquet")
    return root


def tiny_heads(path: Path) -> Path:
    """A heads.json of distinct random scores for the tiny backbone's (layers, KV-heads)."""
    cfg = TinyConfig()
    rng = np.random.default_rng(1)
    shape = (cfg.n_layers, cfg.n_kv_heads)
    write_heads(path, HeadScores(rng.random(shape) + 0.1, rng.random(shape) + 0.1), "tiny")
    return path
