#!/usr/bin/env bash
# GPU check of the Pallas kernels (issue 3): GPU-marked tests + both kernel benchmarks.
#
# usage: scripts/gpu_check.sh OUT_DIR
#
# Installs nothing; needs a Python with jax for CUDA or ROCm, flax, numpy, tqdm, pytest and
# hypothesis (set PYTHON to pick the interpreter; default python3).  Writes into
# OUT_DIR: devices.txt, tests.txt + tests.xml (pytest), transfer.json + transfer.txt,
# attention.json + attention.txt, startup.json + startup.txt, summary.txt.  Each step has its own time limit so
# the whole run ends in under 13 minutes on one GPU; a failing step is recorded and
# the next one still runs.  Exit status: 0 if every step passed, else 1.
set -uo pipefail

OUT_DIR=${1:?usage: scripts/gpu_check.sh OUT_DIR}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export STRATA_TEST_GPU=1 PYTHONUNBUFFERED=1
unset JAX_PLATFORMS STRATA_KERNEL_BACKEND
status=0

step() {  # step NAME LIMIT_S LOGFILE CMD...
  local name=$1 limit=$2 log=$3
  shift 3
  local start=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT_DIR/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

: >"$OUT_DIR/summary.txt"
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" \
  >"$OUT_DIR/devices.txt" 2>&1
cat "$OUT_DIR/devices.txt"

BENCH=("$PY" -c "import sys; from strata_jax.bench import run_benchmark; sys.exit(run_benchmark(sys.argv[1], sys.argv[2:]))")

# Only the GPU module is collected: others import server extras (fastapi, uvicorn) a GPU
# image may lack, and a collection error would fail the step however the GPU tests went.
step tests 270 "$OUT_DIR/tests.txt" \
  "$PY" -m pytest tests/test_pallas_gpu.py tests/test_sliding_window.py tests/test_kv_tier_format.py tests/test_kv_fp8_l1.py -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
  --junitxml "$OUT_DIR/tests.xml"
step transfer 120 "$OUT_DIR/transfer.txt" "${BENCH[@]}" transfer --json "$OUT_DIR/transfer.json"
step attention 60 "$OUT_DIR/attention.txt" "${BENCH[@]}" attention --json "$OUT_DIR/attention.json"
# Issue 10: a 32-layer Llama-3.1-8B-width model (random bf16 weights, 16 GB): compile time of
# its decode + extend programs and their step times, layers under scan vs the unrolled loop.
step startup 300 "$OUT_DIR/startup.txt" "${BENCH[@]}" startup --step-times 32 --width llama-3.1-8b \
  --step-reps 10 --json "$OUT_DIR/startup.json"

{
  echo "--- tests"
  tail -n 15 "$OUT_DIR/tests.txt"
  echo "--- transfer"
  cat "$OUT_DIR/transfer.txt"
  echo "--- attention"
  cat "$OUT_DIR/attention.txt"
  echo "--- startup (32-layer 8B width: compile time, scan vs unrolled step times)"
  cat "$OUT_DIR/startup.txt"
} >>"$OUT_DIR/summary.txt"
cat "$OUT_DIR/summary.txt"
exit "$status"
