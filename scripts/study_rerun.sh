#!/usr/bin/env bash
# Re-run docs/study.md's headline tables with a given hardware profile, e.g. one that
# `strata-jax simulate --calibrate` (or scripts/gpu_check.sh) measured on a GPU, so the
# first GPU run replaces the study's assumed constants with measurements in minutes.
#
# usage: scripts/study_rerun.sh [--profile PROFILE] [--quick] OUT_DIR
#
#   --profile PROFILE  h200 | gh200 or a profile JSON (default h200: the study as written)
#   --quick            every table with 30 requests and its first two rates (~20 s on
#                      2 cores): a smoke run; tests/test_study_rerun.py runs it
#
# Tables (the study's sections; each writes OUT_DIR/<name>.txt, the table as printed, and
# OUT_DIR/<name>.json, every run's numbers), with minutes on this 2-core CPU:
#   cold      section 1/2 cold: hicache vs strata from an empty cache, rates 1-8, 1,000 requests  ~1
#   warm      section 2 warm:   hicache vs strata after a warm-up pass, rates 2-16 (the 3.2-4.2x) ~2
#   stages    section 3: each Strata stage added in turn at rate 3, per cache distance         ~2
#   fp8       section 8: full vs fp8 tiers, hicache and strata, rates 2-36, warm                 ~3
#   windows   section 9: Gemma 3 27B, full vs window-aware loads, rates 0.05-16, warm          ~2
# and OUT_DIR/summary.txt: every table as printed, with the sustained rate at mean TTFT <= 2 s
# per system that `strata-jax simulate` prints under it.
# Exit status: 0 if every table ran, else 1 (the others still run).
set -uo pipefail

PROFILE=h200
QUICK=0
OUT_DIR=
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) [ $# -ge 2 ] || { echo "--profile needs a value" >&2; exit 2; }; PROFILE=$2; shift ;;
    --quick) QUICK=1 ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "unknown option $1; usage: scripts/study_rerun.sh [--profile PROFILE] [--quick] OUT_DIR" >&2; exit 2 ;;
    *) [ -z "$OUT_DIR" ] || { echo "usage: scripts/study_rerun.sh [--profile PROFILE] [--quick] OUT_DIR" >&2; exit 2; }
       OUT_DIR=$1 ;;
  esac
  shift
done
[ -n "$OUT_DIR" ] || { echo "usage: scripts/study_rerun.sh [--profile PROFILE] [--quick] OUT_DIR" >&2; exit 2; }
if [ -f "$PROFILE" ]; then PROFILE=$(cd "$(dirname "$PROFILE")" && pwd)/$(basename "$PROFILE"); fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
: >"$OUT_DIR/summary.txt"
echo "profile: $PROFILE$([ "$QUICK" = 1 ] && echo ' (quick: 30 requests, two rates per table)')" >>"$OUT_DIR/summary.txt"

# table NAME RATES REQUESTS ARGS...: one `strata-jax simulate` run; --quick keeps the first two rates
table() {
  local name=$1 rates=$2 requests=$3
  shift 3
  if [ "$QUICK" = 1 ]; then
    rates=$(echo "$rates" | cut -d, -f1-2)
    requests=30
  fi
  echo "== $name: simulate --rates $rates --num-requests $requests $*" | tee -a "$OUT_DIR/summary.txt"
  if "$PY" -m serving.cli simulate --profile "$PROFILE" --rates "$rates" --num-requests "$requests" \
      --no-progress --json "$OUT_DIR/$name.json" "$@" >"$OUT_DIR/$name.txt" 2>&1; then
    # the table and the sustained-rate block simulate prints under it
    grep -v '^wall ' "$OUT_DIR/$name.txt" >>"$OUT_DIR/summary.txt"
  else
    echo "FAILED (see $name.txt)" | tee -a "$OUT_DIR/summary.txt"
    tail -5 "$OUT_DIR/$name.txt" >&2
    status=1
  fi
}

table cold 1,2,3,4,6,8 1000 --systems hicache,strata
table warm 2,3,4,5,6,8,10,12,14,16 1000 --systems hicache,strata --warmup
for distance in max shuffle min; do
  table "stages-$distance" 3 1000 --systems hicache,+gpu-io,+delay-hit,+balanced-batch,strata,strata+lor \
    --cache-distance "$distance"
done
table fp8 2,4,5,6,8,10,12,14,16,20,24,28,32,36 1000 --systems hicache,strata --kv-tier-format full,fp8 --warmup
table windows 0.05,0.1,0.2,0.5,1,2,4,6,8,10,12,16 200 --model gemma-3-27b --loads full,window \
  --systems hicache,strata --warmup

cat "$OUT_DIR/summary.txt"
exit $status
