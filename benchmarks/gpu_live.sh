#!/usr/bin/env bash
# GPU check of live decoding (for the `device` tool; < 8 min). Random-weight decoder with the
# shape of minivox's (30 layers, 9 q-heads, 3 kv-heads, head dim 64), 120 s and 600 s of audio
# (1500 / 7500 audio tokens at 12.5 tok/s), bf16 on CUDA. Reports, one JSON line each
# (also in $OUT/gpu_live.jsonl):
#   1. ms/token, decode-time peak and post-prefill allocated memory (CUDA), device audio KV MB
#      and H2D MB/step (from the tiers and as really copied) for plain generate and
#      full vs wnw@0.2, masking emulation vs physical offload (pinned host mirror, copy stream);
#      arkvale@0.2 on the masking path selecting on the device and on the host;
#   2. exactness on CUDA (fp32, tiny backbone): full == plain generate; wnw / arkvale masking
#      emulation == physical offload token for token.
#
# Preparation on the CPU machine (the GPU image lacks some packages; see
# the GPU machine's instructions): py3.12 manylinux wheels of polars==2.1.0 and
# polars-runtime-32==2.1.0 in .whl/ (the image has torch, transformers 5.17, numpy, rich, typer,
# sacrebleu, safetensors; the bench needs nothing else), and kvsim itself as a wheel
# (`pip wheel --no-deps -w .whl .`: its subpackages live in top-level folders, so the source
# tree alone does not import), run with carry [".whl"]:
#   bash benchmarks/gpu_live.sh
# DEVICE=cpu SMALL=1 runs the same script on the CPU (dry run, minutes on 1 thread).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
. benchmarks/_device_env.sh
device_env python3 "${OUT:-/tmp/gpu_live}" kvsim.live || exit 3
DEVICE=${DEVICE:-cuda}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
if [ "${SMALL:-0}" = 1 ]; then SECS="20"; STEPS=8; DT=float32; else SECS="120 600"; STEPS=128; DT=bfloat16; fi
# AUDIO_SECONDS="120" (or "" for the exactness check alone) overrides the audio lengths
if [ -n "${AUDIO_SECONDS+x}" ]; then SECS=$AUDIO_SECONDS; fi
T0=$(date +%s)
for s in $SECS; do
  timeout 200 python3 -m kvsim.live.bench --device "$DEVICE" --dtype "$DT" --seconds "$s" \
    --policies full,wnw --budget 0.2 --paths mask,physical --steps "$STEPS" \
    | tee -a "$OUTDIR/gpu_live.jsonl"
  # ArkVale selecting on the device (default on CUDA) against the host (NumPy, a copy per layer)
  for sel in device host; do
    timeout 200 python3 -m kvsim.live.bench --device "$DEVICE" --dtype "$DT" --seconds "$s" \
      --policies arkvale --budget 0.2 --paths mask --steps "$STEPS" --select "$sel" \
      | sed "s/^{/{\"select\": \"$sel\", /" | tee -a "$OUTDIR/gpu_live.jsonl"
  done
done
timeout 120 python3 - <<PY 2>&1 | tee "$OUTDIR/gpu_live_exactness.log"
import numpy as np, torch
from kvsim.policies.spec import PolicySpec
from kvsim.policies.base import HeadScores
from kvsim.live.decode import LiveConfig, live_generate, plain_generate
from kvsim.live.models import TinyBackbone, TinyConfig
torch.set_num_threads(1)
lm = TinyBackbone(TinyConfig(n_layers=4, n_q_heads=8, n_kv_heads=4, head_dim=32), device="$DEVICE")
rng = np.random.default_rng(0)
p = lm.prepare((0.1 * rng.standard_normal(16000 * 40)).astype(np.float32))
hs = HeadScores(rng.random((4, 4)), rng.random((4, 4)))
ref = plain_generate(lm, p, 48)
ok = True
for name, b in [("full", 1.0), ("wnw", 0.2), ("arkvale", 0.2), ("arkvale", 0.4)]:
    runs = [live_generate(lm, p, PolicySpec(name, b), LiveConfig(48, physical=ph, head_scores=hs)) for ph in (False, True)]
    same = runs[0].tokens == runs[1].tokens
    ident = runs[0].tokens == ref
    ok &= same and (ident or name != "full")
    print(f"{name}@{b}: mask==physical {same}  ==plain {ident}  r_gpu {runs[1].summary['r_gpu']:.3f} "
          f"phys H2D MB/step {runs[1].summary['physical_h2d_mb_per_step']:.4f} copies/step {runs[1].summary['physical_copies_per_step']:.1f}")
print("EXACTNESS", "OK" if ok else "FAILED")
PY
echo "gpu_live.sh wall $(( $(date +%s) - T0 )) s"
