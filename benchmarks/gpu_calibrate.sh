#!/usr/bin/env bash
# Calibrate the hardware simulator on a lent CUDA GPU (target: < 8 minutes on one H200).
#   bash benchmarks/gpu_calibrate.sh            # writes to $OUT (or runs/calibrate/)
# Steps: environment record, copy sweep + per-call overhead + decoder-layer decode vs KV
# length (kvsim calibrate-hw --quick), eager-decode host cost on the GPU (hostprobe on cuda),
# then the simulator with the fitted preset vs the shipped one.
# On a machine where kvsim is not installed (the device tool's GPU image), carry py3.12
# manylinux wheels in .whl/ of polars==2.1.0, polars-runtime-32==2.1.0, simpy==4.1.2 and kvsim
# itself (`pip wheel --no-deps -w .whl .`): they are installed under /tmp/site.
set -uo pipefail
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi
fi
. "$(dirname "$0")/_device_env.sh"
device_env "$PY" "${OUT:-runs/calibrate}" kvsim.sim || exit 3
OUT=$OUTDIR
export OMP_NUM_THREADS=1
BASE="${BASE:-h200}"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/log.txt"; }

log "host: $(hostname)  python: $($PY -V 2>&1)"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv | tee "$OUT/nvidia-smi.csv"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "torch has no CUDA here: $($PY -c 'import torch; print(torch.__version__)' 2>&1)"; exit 3
fi
$PY -c "import simpy, polars, typer, kvsim.sim" || { log "missing packages (see the header)"; exit 3; }

log "1/3 calibrate-hw --quick (copy sweep 4 KiB-1 GiB, overheads, layer decode vs 3 KV lengths)"
timeout 240 $PY -m kvsim calibrate-hw --quick --base "$BASE" --model voxtral-mini-3b \
  -o "$OUT/$BASE-calibrated.toml" --name "$BASE-calibrated" 2>&1 | tee -a "$OUT/log.txt"

log "2/3 eager-decode host cost on the GPU (30-layer tiny-width Llama, Voxtral head layout)"
timeout 90 $PY -m kvsim calibrate-hw --host-only --device cuda --model voxtral-mini-3b \
  2>&1 | grep '^{' | tee "$OUT/hostprobe_cuda.jsonl"

log "3/3 simulator: shipped vs calibrated preset, WnW 235 tidal heads, 4-min audio"
for g in "$BASE" "$OUT/$BASE-calibrated.toml"; do
  timeout 45 $PY -m kvsim simulate --model voxtral-mini-3b --gpu "$g" --policy wnw \
    --tidal-heads 235 --retention 0.2 --audio-minutes 4 -m sync,overlap,coalesced \
    --runtime hf-eager 2>&1 | tee -a "$OUT/log.txt"
done
log "done; outputs in $OUT"
