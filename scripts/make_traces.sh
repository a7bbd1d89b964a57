#!/usr/bin/env bash
# Regenerate the shipped real traces: minivox decoding held-out espeak test audio, with values,
# and per-head scores (WnW App. E) calibrated on the disjoint calibration split.
#   bash scripts/make_traces.sh            # data under data/minivox (made if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
DATA=${DATA:-data/minivox}
CLIP=${CLIP:-test_30_60-00013}   # 59.6 s, 160 words: two full 30 s windows
if [ ! -f "$DATA/manifest.parquet" ]; then
  python -m kvsim.minivox.data --out "$DATA" --seed 0 --splits calib test_30_60 test_long
fi
# WnW App. E on the 50 calibration clips, 16 answer tokens spread over each answer (one backward
# pass each), two shards in parallel (about 35 min on 2 cores), merged by sample counts
CAL=$(mktemp -d)
kvsim calibrate --model minivox $(ls "$DATA"/audio/calib/*.flac | head -25) --out "$CAL/a.json" \
  --aligner reference --max-tokens 16 --max-new-tokens 300 &
SHARD_A=$!
kvsim calibrate --model minivox $(ls "$DATA"/audio/calib/*.flac | tail -25) --out "$CAL/b.json" \
  --aligner reference --max-tokens 16 --max-new-tokens 300
wait "$SHARD_A"   # a failed shard stops the script (set -e)
python scripts/merge_heads.py minivox/heads.json "$CAL/a.json" "$CAL/b.json"
kvsim trace --model minivox "$DATA/audio/test_30_60/$CLIP.flac" --out traces \
  --values --heads minivox/heads.json --max-new-tokens 400 --overwrite
rm -rf "traces/minivox-$CLIP.kvtrace" && mv "traces/$CLIP.kvtrace" "traces/minivox-$CLIP.kvtrace"
rm -f traces/run.json   # the run record `kvsim trace` writes beside its traces: not shipped
# the synthetic large-shape trace kept beside it (qwen-omni shape, 5 s)
rm -rf traces/synth-qwen-omni-5s.kvtrace
kvsim synth traces/synth-qwen-omni-5s.kvtrace --preset qwen-omni --audio-seconds 5 --decode-steps 16 --seed 1
kvsim validate traces
