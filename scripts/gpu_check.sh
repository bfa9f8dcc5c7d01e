#!/usr/bin/env bash
# GPU check: GPU-marked kernel tests, the L2->L1 load paths, a real engine on a long
# document, a calibrated simulator profile and a mixture-of-experts model against the CPU,
# in at most 8 minutes on one GPU (H200).
#
# usage: scripts/gpu_check.sh [--dry-run] OUT_DIR
#
#   --dry-run   the same steps with tiny shapes on the CPU (JAX_PLATFORMS=cpu; 2-2.5 min on
#               2 cores); tests/test_gpu_check.py runs it so the script cannot rot.
#
# Installs nothing.  Needs a Python (PYTHON, default python3) with jax (+ its CUDA or ROCm
# plugin), flax, numpy, safetensors, tqdm, pytest and hypothesis; not the serve extras.
#
# Steps, each time-boxed with `timeout` (SIGINT at its limit - 5 s, so pytest still writes
# its XML and the benchmarks their JSON so far; SIGKILL at the limit).  A failing step is
# recorded and the next still runs.  Expected minutes on one H200 / limit:
#   devices    0.2 / 0.33  strata-jax info (+ nvidia-smi)                   -> devices.txt
#   tests      1.7 / 2.08  pytest -m gpu (kernel modules that import without
#                          the serve extras)                                 -> tests.xml
#   transfer   0.7 / 1.0   bench transfer: L2->L1 loads at page sizes 1/16/64, GB/s per path
#                          (one device_put of a page-first staging buffer; from pinned_host
#                          jax arrays; per-page copies; the engine's pipelined load) against
#                          the link's peak (a contiguous 1 GiB copy, pageable and pinned)
#                                                                            -> transfer.json
#   roofline   2.1 / 2.83  bench roofline: Llama-3.1-8B width (32 layers, random bf16
#                          weights), 16K-token document: TTFT cold/L1/L2, prefill MFU,
#                          decode step ms + HBM utilisation at batch 1/64/256 (1K-token
#                          contexts), a speculative verification of 8 tokens per row at
#                          batch 1/64 against its decode (the break-even acceptance), a mixed
#                          step (the 8K chunk with the decode rows of batch 1/64 in its program)
#                          against the two programs, against the device's memory bandwidth
#                          and matmul rate measured in the same run
#                                                                            -> roofline.json
#   calibrate  0.4 / 0.75  strata-jax simulate --calibrate (a profile of this device)
#                                                                -> calibrated_profile.json
#   moe        0.6 / 0.75  python -m strata_jax.bench.gpu_check moe: a tiny random qwen2_moe
#                          (8 experts, top-2, shared expert; float32) through the real engine
#                          on the GPU, its greedy tokens and logits against the same model on
#                          jax's CPU backend (a child process, run alongside), decode and
#                          prefill step ms; then bench moe's layer comparison (Qwen3-30B-A3B
#                          layer, bf16: ragged_dot experts vs a dense matmul of the same FLOPs
#                          vs the masked per-expert loop) while its time lasts  -> moe.json
#   summary    0.0 / 0.17  the numbers a human wants, from the files above   -> summary.txt
#   total      5.6 / 7.9   (plus at most a few seconds of shell; every step also stops when
#                          the script's 8 minutes are up)
#
# OUT_DIR gets at most 8 files: summary.txt (step status + the numbers a human wants: GB/s
# per load path and page size vs the link's peak, TTFT cold/L1/L2, decode step ms and HBM %
# per batch, prefill MFU %, the calibrated profile, the MoE verdict and times), devices.txt,
# log.txt (every step's output), tests.xml, transfer.json, roofline.json,
# calibrated_profile.json, moe.json.
# Exit status: 0 if every step passed, else 1.
set -uo pipefail

DRY_RUN=0
OUT_DIR=
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    -*) echo "unknown option $arg; usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2; exit 2 ;;
    *) [ -z "$OUT_DIR" ] || { echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2; exit 2; }; OUT_DIR=$arg ;;
  esac
done
[ -n "$OUT_DIR" ] || { echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2; exit 2; }
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
unset STRATA_KERNEL_BACKEND
if [ "$DRY_RUN" = 1 ]; then
  export JAX_PLATFORMS=cpu
  unset STRATA_TEST_GPU
else
  unset JAX_PLATFORMS
  export STRATA_TEST_GPU=1
fi

BUDGET_S=480  # 8 minutes, the whole script
status=0
SUMMARY="$OUT_DIR/summary.txt"
LOG="$OUT_DIR/log.txt"
: >"$SUMMARY"
: >"$LOG"
rm -f "$OUT_DIR"/{devices.txt,tests.xml,transfer.json,roofline.json,calibrated_profile.json,moe.json}

step() {  # step NAME LIMIT_S CMD...: output appended to log.txt (devices: to devices.txt as well)
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  [ "$limit" -le "$left" ] || limit=$left
  if [ "$limit" -le 5 ]; then
    echo "step $name: FAILED (skipped: the script's $BUDGET_S s are up)" | tee -a "$SUMMARY"
    status=1
    return
  fi
  local start=$SECONDS
  echo "===== $name (limit $limit s) $(date -u +%FT%TZ)" >>"$LOG"
  timeout -s INT -k 5 "$((limit - 5))" "$@" >>"$LOG" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  echo "===== $name: rc=$rc after $took s" >>"$LOG"
  if [ "$rc" -eq 0 ]; then
    echo "step $name: ok ($took s, limit $limit s)" | tee -a "$SUMMARY"
  else
    local why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=", timed out"
    echo "step $name: FAILED rc=$rc$why ($took s, limit $limit s)" | tee -a "$SUMMARY"
    status=1
  fi
}

# SIGINT handled as KeyboardInterrupt even where this script was started with it ignored
# (a background job): the step's limit then ends pytest / a benchmark cleanly.
INT='import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)'
export CLI_PY="$INT; from strata_jax.cli import main; sys.exit(main(sys.argv[1:]))"
CLI=("$PY" -c "$CLI_PY")
BENCH=("${CLI[@]}" bench)
PYTEST=("$PY" -c "$INT; import pytest; sys.exit(pytest.main(sys.argv[1:]))")
# Only kernel modules that import without the serve extras (fastapi, uvicorn, grpc, redis,
# gguf), which a GPU image may lack: a collection error would fail the step however the
# GPU tests went.
TESTS=(tests/test_pallas_gpu.py tests/test_sliding_window.py tests/test_kv_tier_format.py tests/test_kv_fp8_l1.py)

if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check --dry-run: tiny shapes on the CPU" | tee -a "$SUMMARY"
  TRANSFER=(--layers 4 --kv-heads 2 --head-dim 64 --dtype float32 --page-sizes 1,16 --total-mb 1 --repeats 3 --peak-mb 8)
  ROOFLINE=(--width tiny --doc-tokens 512 --prefill-chunk 256 --batches 1,2,4 --decode-context 64 --step-reps 3
    --verify-tokens 8 --verify-batches 1,4)
  MOE=(--dry-run)
  L_DEVICES=60 L_TESTS=60 L_TRANSFER=45 L_ROOFLINE=120 L_CALIBRATE=45 L_MOE=200 L_SUMMARY=10  # the tiny MoE engine takes 70 s quiet, over 100 s in a loaded CI
else
  TRANSFER=(--layers 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 --page-sizes 1,16,64 --total-mb 64 --repeats 5 --peak-mb 1024)
  ROOFLINE=(--width llama-3.1-8b --doc-tokens 16384 --prefill-chunk 8192 --batches 1,64,256 --decode-context 1024
    --ttft-repeats 3 --step-reps 10 --verify-tokens 8 --verify-batches 1,64)
  MOE=()
  L_DEVICES=20 L_TESTS=125 L_TRANSFER=60 L_ROOFLINE=170 L_CALIBRATE=45 L_MOE=45 L_SUMMARY=10  # 475 s = 7.9 min
fi

devices() {
  "$PY" -c "$CLI_PY" info
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm \
      --format=csv
  fi
}
export -f devices
export PY OUT_DIR
step devices "$L_DEVICES" bash -c 'set -o pipefail; devices | tee "$OUT_DIR/devices.txt"'
step tests "$L_TESTS" "${PYTEST[@]}" "${TESTS[@]}" -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning \
  --junitxml "$OUT_DIR/tests.xml"
step transfer "$L_TRANSFER" "${BENCH[@]}" transfer "${TRANSFER[@]}" --pinned --tier-formats none --pool-growth 0 \
  --json "$OUT_DIR/transfer.json"
step roofline "$L_ROOFLINE" "${BENCH[@]}" roofline "${ROOFLINE[@]}" --json "$OUT_DIR/roofline.json"
step calibrate "$L_CALIBRATE" "${CLI[@]}" simulate --calibrate "$OUT_DIR/calibrated_profile.json" --profile h200 --no-progress
# the MoE step's own time box ends 10 s inside the step's limit (SIGINT at limit - 5 s)
MOE_BUDGET=$(( (L_MOE < BUDGET_S - SECONDS ? L_MOE : BUDGET_S - SECONDS) - 10 ))
step moe "$L_MOE" "$PY" -c "$INT; from strata_jax.bench.gpu_check import main; sys.exit(main(sys.argv[1:]))" \
  moe "$OUT_DIR/moe.json" ${MOE[@]+"${MOE[@]}"} --budget-s "$MOE_BUDGET"
export SUMMARY_TEXT=$(mktemp)
step summary "$L_SUMMARY" bash -c 'set -o pipefail; "$PY" -m strata_jax.bench.gpu_check summarize "$OUT_DIR" | tee "$SUMMARY_TEXT"'
{
  echo "---"
  grep -E '^(versions|platform):|^  0: ' "$OUT_DIR/devices.txt" 2>/dev/null
  cat "$SUMMARY_TEXT"
  echo "---"
  if [ "$status" -eq 0 ]; then echo "gpu_check: every step passed ($SECONDS s)"; else echo "gpu_check: FAILED ($SECONDS s; see log.txt)"; fi
} >>"$SUMMARY"
rm -f "$SUMMARY_TEXT"
cat "$SUMMARY"
exit "$status"
