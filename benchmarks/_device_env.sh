# Sourced by the GPU scripts (benchmarks/gpu_*.sh), from the repository root.
#
# device_env PYTHON OUTDIR MODULE: install the wheels carried in .whl/ (kvsim's own among them,
# `pip wheel --no-deps -w .whl .`) under /tmp/site, make OUTDIR absolute and enter it (outside
# the source tree, whose ./kvsim would hide the installed package's subpackages), and check
# that MODULE imports. Sets OUTDIR; returns 3 when kvsim is not installed.
device_env() {
  local py=$1 module=$3
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  fi
  mkdir -p "$2"
  OUTDIR=$(cd "$2" && pwd)
  cd "$OUTDIR" || return 3
  "$py" -c "import $module" || { echo "kvsim is not installed here (see the script's header)"; return 3; }
}
