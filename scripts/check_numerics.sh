#!/usr/bin/env bash
# Run the tests that compare floating-point results under several emulated CPU kernels, one
# line per configuration with the kernels it got and its pass/fail counts.
#
# A tolerance tuned on one CPU can fail on another, whose BLAS and SIMD kernels sum in another
# order. Each configuration below forces other kernels on this machine through the switches the
# libraries honour: OPENBLAS_CORETYPE (numpy's bundled OpenBLAS), NPY_DISABLE_CPU_FEATURES
# (numpy's SIMD loops: exp, sums, ...), ATEN_CPU_CAPABILITY (torch's vectorised ops) and
# MKL_CBWR (torch's MKL matrix products). The probe line shows what each one really selected and
# a fingerprint of a few float32 results (gemm, exp, softmax): a switch that changes nothing
# leaves the fingerprint of the native line.
#
# Usage: bash scripts/check_numerics.sh [pytest args]   (default: the numeric test files,
# without the slow marker). KVSIM_PYTHON picks the interpreter (default .venv/bin/python),
# KVSIM_NUMERICS_ONLY=native,numpy-sse4 runs only the named configurations.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${KVSIM_PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=$PWD

# test files that compare float32/torch results with a float64 reference or with each other
NUMERIC_TESTS=(tests/test_replay_engine.py tests/test_policy_h2o.py tests/test_policy_arkvale.py
  tests/test_policy_quest.py tests/test_policy_voxzip.py tests/test_policy_wnw.py
  tests/test_policy_wnw_engine.py tests/test_live.py tests/test_live_vs_replay.py
  tests/test_tracer_capture.py tests/test_transforms.py tests/test_minivox_model.py
  tests/test_calibration.py)
if [ $# -eq 0 ]; then set -- -m "not slow" "${NUMERIC_TESTS[@]}"; fi

SSE_ONLY="AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR AVX2 FMA3 AVX F16C"
CONFIGS=(
  "native|"
  "blas-sandybridge|OPENBLAS_CORETYPE=Sandybridge"
  "blas-katmai|OPENBLAS_CORETYPE=Prescott"
  "numpy-sse4|NPY_DISABLE_CPU_FEATURES=$SSE_ONLY"
  "torch-generic|ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE"
  "old-cpu-all|OPENBLAS_CORETYPE=Prescott NPY_DISABLE_CPU_FEATURES=$SSE_ONLY ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE"
)
if grep -qw avx512f /proc/cpuinfo; then  # on an AVX-512 machine, also force its other paths
  CONFIGS+=("blas-haswell|OPENBLAS_CORETYPE=Haswell" "torch-avx2|ATEN_CPU_CAPABILITY=avx2")
fi

# the kernels a configuration gets, and a fingerprint of their float32 results
PROBE=$(cat <<'EOF'
import ctypes, glob, hashlib, os
import numpy as np
import torch
from numpy._core._multiarray_umath import __cpu_features__ as feats

def fp(a):
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:6]

libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*.so*"))
core = "?"
if libs:
    lib = ctypes.CDLL(libs[0])
    for name in ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_char_p
            core = getattr(lib, name)().decode()
            break
rng = np.random.default_rng(0)
a = rng.standard_normal((64, 333), dtype=np.float32)
b = rng.standard_normal((333, 65), dtype=np.float32)
x = rng.standard_normal(100003).astype(np.float32)
ta, tb = torch.from_numpy(a), torch.from_numpy(b)
simd = "/".join(k for k in ("AVX512F", "AVX2", "FMA3", "AVX", "SSE42") if feats.get(k))
print(f"numpy-simd={simd} openblas={core} torch={torch.backends.cpu.get_cpu_capability()} "
      f"np[gemm={fp(a @ b)} exp={fp(np.exp(x))}] "
      f"torch[mm={fp((ta @ tb).numpy())} softmax={fp(torch.softmax(ta, -1).numpy())}]")
EOF
)

ONLY=${KVSIM_NUMERICS_ONLY:-}  # comma-separated configuration names to run (default: all)
status=0
for cfg in "${CONFIGS[@]}"; do
  name=${cfg%%|*}
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  vars=${cfg#*|}
  # "A=x y B=z" -> one assignment per line (values may hold spaces)
  mapfile -t envs < <(echo "$vars" | sed -E 's/ ([A-Z_]+=)/\n\1/g' | sed '/^$/d')
  kernels=$(env "${envs[@]}" "$PY" - <<<"$PROBE" 2>&1 | tail -1)
  log=$(mktemp)
  env "${envs[@]}" "$PY" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|no tests ran|[0-9]+ (passed|failed|error)" "$log" | tail -1 | sed -E 's/=+//g; s/^ +| +$//g')
  printf '%-16s | %-30s | %s\n' "$name" "${summary:-no summary (rc=$rc)}" "$kernels"
  if [ $rc -ne 0 ]; then
    status=1
    grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
  fi
  rm -f "$log"
done
exit $status
