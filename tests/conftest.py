"""Shared fixtures: small synthetic traces written once per session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from kvsim.synth import SynthConfig, synthesize  # noqa: E402
from kvsim.trace import Trace, write_trace  # noqa: E402


@pytest.fixture(scope="session")
def small_trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 'small'-shape synthetic trace (4 layers, 8 q / 2 kv heads, D=32), with values."""
    d = tmp_path_factory.mktemp("traces")
    return write_trace(d / "small.kvtrace",
                       synthesize(SynthConfig(preset="small", audio_seconds=24, decode_steps=40, seed=3)))


@pytest.fixture()
def small_trace(small_trace_path: Path) -> Trace:
    return Trace(small_trace_path)


def make_trace(path: Path, preset: str = "tiny", seconds: float = 8, steps: int = 12, seed: int = 0,
               values: bool = True) -> Path:
    return write_trace(path, synthesize(SynthConfig(preset=preset, audio_seconds=seconds,
                                                    decode_steps=steps, seed=seed, store_values=values)))
