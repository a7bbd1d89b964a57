#!/usr/bin/env bash
# Set up (if needed) and run the main job: every policy at four budgets over the shipped traces.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
kvsim replay traces/ --policy all --budget 0.2,0.4,0.6,0.8 --plot --out runs/replay "$@"
