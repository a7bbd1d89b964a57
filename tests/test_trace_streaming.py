"""Layer-at-a-time trace writing, synthesis and reading, and head-at-a-time prefill attention,
give exactly what the whole-array paths gave: the same bytes on disk, the same arrays in memory
(all exact by construction: the same float casts and products, element by element)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvsim.core.attention import causal_attention, causal_attention_columns
from kvsim.core.views import WindowPrefillView
from kvsim.replay.tensors import TraceTensors
from kvsim.synth import SynthConfig, synthesize, write_synthetic
from kvsim.trace import tensors
from kvsim.trace.reader import Trace
from kvsim.trace.schema import TraceError
from kvsim.trace.tensors import first_nonfinite
from kvsim.trace.writer import TraceWriter, write_trace


def _tiny(store_values: bool = True):
    return synthesize(SynthConfig(preset="tiny", audio_seconds=4, decode_steps=5, seed=2,
                                  store_values=store_values))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("store_values", [True, False])
def test_streamed_tensors_file_is_what_save_file_writes(tmp_path: Path, dtype: str,
                                                        store_values: bool) -> None:
    data = _tiny(store_values)
    data.meta.model = dataclasses.replace(data.meta.model, dtype=dtype)
    path = write_trace(tmp_path / "t", data)
    tensors = {"keys": data.keys.astype(dtype), "queries": data.queries.astype(dtype),
               "query_positions": data.query_positions.astype(np.int64)}
    if store_values:
        tensors["values"] = data.values.astype(dtype)
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "kvsim.trace"})
    assert (path / "tensors.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_write_synthetic_is_synthesize_then_write_trace(tmp_path: Path) -> None:
    cfg = SynthConfig(preset="small", audio_seconds=6, decode_steps=7, seed=5)
    a = write_trace(tmp_path / "whole", synthesize(cfg))
    b = write_synthetic(tmp_path / "streamed", cfg)
    for name in ("tensors.safetensors", "positions.parquet", "heads.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_writer_left_without_finish_leaves_no_trace(tmp_path: Path) -> None:
    data = _tiny()
    args = (data.meta.model, data.meta.n_positions, data.query_positions, True)
    with pytest.raises(RuntimeError, match="without finish"), \
            TraceWriter(tmp_path / "t", *args) as writer:
        writer.write_layer(0, data.keys[0], data.queries[0], data.values[0])
    assert not (tmp_path / "t.kvtrace").exists()
    with pytest.raises(ValueError, match="never written"), \
            TraceWriter(tmp_path / "u", *args) as writer:
        writer.write_layer(0, data.keys[0], data.queries[0], data.values[0])
        writer.finish(data.meta, data.positions, data.head_scores)  # layer 1 missing
    assert not (tmp_path / "u.kvtrace").exists()


def test_read_layer_matches_the_memory_map_and_rejects_nan(tmp_path: Path) -> None:
    data = _tiny()
    trace = Trace(write_trace(tmp_path / "t", data))
    for layer in range(data.meta.model.n_layers):
        for name in ("keys", "queries", "values"):
            got = trace.read_layer(name, layer)
            assert got.dtype == np.float16
            assert np.array_equal(got, np.asarray(getattr(trace, name)(layer)))
    tensors = TraceTensors.load(trace)
    assert np.array_equal(tensors.keys[1], data.keys[1].astype(np.float16).astype(np.float32))
    data.keys[1, 0, 3, 2] = np.nan
    bad = Trace(write_trace(tmp_path / "bad", data))
    with pytest.raises(TraceError, match=r"tensors\.safetensors: keys: non-finite .* layer 1"):
        bad.read_layer("keys", 1)


def test_prefill_view_with_a_small_cache_gives_the_same_attention(tmp_path: Path) -> None:
    trace = Trace(write_trace(tmp_path / "t", _tiny()))
    keys = TraceTensors.load(trace).keys
    window = trace.window_positions
    rows = np.array([trace.query_index(int(p)) for p in window])

    def queries(layer: int) -> np.ndarray:
        return np.asarray(trace.queries(layer)[:, rows], dtype=np.float32)

    full = WindowPrefillView(queries, keys, window, trace.audio_positions, cache_bytes=1 << 40)
    one = full.audio_attention(0).nbytes
    small = WindowPrefillView(queries, keys, window, trace.audio_positions, cache_bytes=one)
    for _ in range(2):  # two scans: layer 0 cached, layer 1 recomputed
        for layer in range(len(keys)):
            assert np.array_equal(small.audio_attention(layer), full.audio_attention(layer))
    assert list(small._cache) == [0]


@pytest.mark.parametrize(("h_kv", "group", "n", "d", "seed"),
                         [(1, 1, 9, 4, 0), (2, 4, 40, 8, 1), (8, 4, 300, 16, 2)])
def test_prefill_attention_one_kv_head_at_a_time_is_the_whole_layers(
        h_kv: int, group: int, n: int, d: int, seed: int) -> None:
    """The prefill view's per-KV-head attention equals the whole layer's, bit for bit, for
    contiguous and scattered columns and for queries in either memory order."""
    rng = np.random.default_rng(seed)
    keys = (rng.normal(size=(h_kv, n, d)) * 2).astype(np.float32)
    window = np.sort(rng.choice(np.arange(n // 2, n), size=min(5, n // 2), replace=False))
    q = rng.normal(size=(h_kv * group, len(window), d)).astype(np.float32)
    span = int(window.max()) + 1  # the attention covers keys [0, last window position]
    for columns in (np.arange(1, n // 2), np.sort(rng.choice(span, size=span // 3, replace=False))):
        whole = causal_attention(q, keys, window)[:, :, columns]
        for queries in (q, np.asfortranarray(q)):
            per_head = causal_attention_columns(queries, keys, window, columns)
            assert per_head.dtype == np.float32 and per_head.flags.c_contiguous
            assert per_head.tobytes() == np.ascontiguousarray(whole).tobytes()


def test_first_nonfinite_on_float16_bits_agrees_with_isfinite_on_every_half() -> None:
    """The float16 NaN/inf test reads exponent bits; every one of the 65,536 half values is
    classified as ``np.isfinite`` classifies it, and the first bad index is the same."""
    every_half = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(every_half.astype(np.float32))
    for i in np.flatnonzero(~finite)[:: 97].tolist() + [int(np.flatnonzero(~finite)[-1])]:
        arr = np.zeros((2, 3, 4), dtype=np.float16)
        arr.reshape(-1)[7:] = every_half[i]
        assert first_nonfinite(arr) == (0, 1, 3)
    assert first_nonfinite(every_half[finite].reshape(-1, 8)) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_first_nonfinite_on_wider_floats_agrees_with_isfinite(dtype) -> None:
    """float32 and float64 are tested on their bits too: every class of value at the edge of
    finiteness (±inf, quiet and signalling NaNs of either sign and any payload, the largest
    finite, the smallest subnormal, ±0) is classified as ``np.isfinite`` classifies it."""
    info, uint = np.finfo(dtype), {np.float32: np.uint32, np.float64: np.uint64}[dtype]
    nbits = 8 * np.dtype(dtype).itemsize
    exponent = ((1 << info.nexp) - 1) << info.nmant  # every exponent bit set
    sign = 1 << (nbits - 1)
    patterns = [exponent, exponent | 1, exponent | (1 << (info.nmant - 1)), exponent | ((1 << info.nmant) - 1)]
    specials = np.array(patterns + [p | sign for p in patterns], dtype=uint).view(dtype)
    edges = np.array([info.max, -info.max, info.smallest_subnormal, 0.0, -0.0], dtype=dtype)
    for value in np.concatenate([specials, edges]):
        arr = np.ones((3, 5), dtype=dtype)
        arr[1, 2:] = value
        with np.errstate(invalid="ignore"):
            expected = None if np.isfinite(value) else (1, 2)
        assert first_nonfinite(arr) == expected


def test_first_nonfinite_finds_the_first_bad_value_across_chunks() -> None:
    """The test runs a chunk at a time: a bad value at either edge of a chunk, in the last
    partial chunk, or behind another one later on is found at its own index, in the array's
    own (C-order) indexing also for a non-contiguous view."""
    chunk = tensors._CHUNK
    n = 3 * chunk + 5
    for dtype in (np.float16, np.float32):
        for at in (0, chunk - 1, chunk, 2 * chunk + 1, n - 1):
            arr = np.zeros(n, dtype=dtype)
            arr[at] = np.nan
            arr[min(at + chunk + 3, n - 1)] = np.inf  # a later one does not hide it
            assert first_nonfinite(arr) == (at,)
            assert first_nonfinite(arr.reshape(1, n)) == (0, at)
        grid = np.zeros((chunk // 4 + 3, 8), dtype=dtype)
        grid[chunk // 4 + 1, 6] = -np.inf
        assert first_nonfinite(grid.T) == (6, chunk // 4 + 1)  # transposed: index in grid.T
        assert first_nonfinite(grid[:0]) is None
