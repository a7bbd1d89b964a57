"""Peak memory of synthesis and replay stays bounded by what one layer / the float32 keys need.

Each measurement runs in a fresh process: it first synthesises and replays a tiny trace (so
every module is imported and every code path warmed), records its resident set, then does the
measured work and reports its peak resident set (``VmHWM``). The growth over the warm process
is compared with the trace's stored key bytes (float16):

* ``write_synthetic`` holds one layer at a time: float32 keys and queries of one layer are
  2/L of the key bytes (L = 30 for Voxtral-mini), plus a float64 feature matrix per KV-head;
  the bound, a quarter of the key bytes + 32 MiB, is far below the 2x that holding the float32
  keys of every layer costs (``synthesize``).
* replay holds the float32 keys of every layer, 2x the key bytes, plus the prefill view's
  cache (at most ``PREFILL_CACHE_BYTES``), the decode steps' attention computed ahead (at
  most ``ReplayConfig.attention_block_mib``), step buffers proportional to T_a and allocator
  slack (64 MiB); the bound is 2.5x the key bytes plus those. The code before (memory-mapped
  pages resident beside the float32 copy, every layer's window attention cached) took about
  5x. The policies replayed are ``full``, ``snapkv``, ``wnw`` and ``arkvale``.

What replay allocates beyond the float32 keys is also counted exactly (``tracemalloc``, which
sees numpy's arrays), in units of one layer's float32 keys, (H_kv, N, D): the peak over the
replay, less the prefill view's cache, must stay within 6 layers (measured 4.7 on the 150 s
trace; 7.2 before the prefill attention was computed a KV-head at a time, ArkVale's prefill
scores a layer at a time, its page digests a head at a time and stacked without per-layer
copies, and WnW's step attention kept for its anchor layers only). Everything counted there
grows with the audio, as the keys do, so the same count holds at an hour. That count is taken
with the decode steps' attention computed one step and layer at a time
(``attention_block_mib=0``): the block of steps computed ahead is sized to its budget by
construction (``tests/test_attention_block.py``), and the resident-set bound above includes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsim.core.views import PREFILL_CACHE_BYTES
from kvsim.replay.engine import ReplayConfig

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

CHILD = """
import gc, json, sys
from kvsim.replay.engine import PolicySpec, ReplayConfig, Replayer
from kvsim.synth import SynthConfig, write_synthetic
from kvsim.trace.reader import Trace

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/self/status: no {field}")

mode, target, warm = sys.argv[1:4]
specs = [PolicySpec(name, 0.2) for name in ("full", "snapkv", "wnw", "arkvale")]
if mode == "traced":  # bytes allocated beyond the loaded keys, at the replay's peak
    import tracemalloc
    tracemalloc.start()
    rep = Replayer(Trace(target), ReplayConfig(max_steps=2, attention_block_mib=0))
    loaded = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    rep.run(specs)
    print(json.dumps({"beyond_keys": tracemalloc.get_traced_memory()[1] - loaded,
                      "layer": rep.tensors.keys[0].nbytes}))
    raise SystemExit
write_synthetic(warm, SynthConfig(preset="tiny", audio_seconds=4, decode_steps=3,
                                  store_values=False))
Replayer(Trace(warm + ".kvtrace"), ReplayConfig(max_steps=2)).run(specs)
gc.collect()
rss0 = status("VmRSS")
if mode == "synth":
    write_synthetic(target, SynthConfig(preset="voxtral-mini", audio_seconds=150,
                                        decode_steps=20, store_values=False))
else:
    Replayer(Trace(target), ReplayConfig(max_steps=2)).run(specs)
print(json.dumps({"rss0": rss0, "hwm": status("VmHWM")}))
"""


def child(mode: str, target: Path, tmp_path: Path) -> dict:
    """What the child process of ``mode`` reports."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(target), str(tmp_path / mode)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def growth(mode: str, target: Path, tmp_path: Path) -> int:
    """Peak resident bytes of ``mode`` beyond the warmed-up process."""
    res = child(mode, target, tmp_path)
    return res["hwm"] - res["rss0"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_synth_and_replay_peak_memory_stay_bounded(tmp_path: Path) -> None:
    trace = tmp_path / "vox150s.kvtrace"
    synth_growth = growth("synth", trace, tmp_path)
    meta = json.loads((trace / "meta.json").read_text())
    m = meta["model"]
    key_bytes = m["n_layers"] * m["n_kv_heads"] * meta["n_positions"] * m["head_dim"] * 2
    assert key_bytes > 100e6  # large enough that 2x of it dwarfs the constant terms
    assert synth_growth <= 0.25 * key_bytes + 32 * MIB, (synth_growth, key_bytes)
    replay_growth = growth("replay", trace, tmp_path)
    block = ReplayConfig().attention_block_mib * MIB
    assert replay_growth <= 2.5 * key_bytes + PREFILL_CACHE_BYTES + block + 64 * MIB, (
        replay_growth, key_bytes)
    traced = child("traced", trace, tmp_path)  # without the attention block (bounded above)
    layers = (traced["beyond_keys"] - PREFILL_CACHE_BYTES) / traced["layer"]
    assert layers <= 6, traced
