#!/usr/bin/env bash
# lm-evaluation-harness `local-completions` against `strata-jax serve`: a small local
# multiple-choice task scored by loglikelihood (scripts/lm_eval_loglikelihood_task/: 24
# questions, 4 choices each).  lm-eval sends each (question, choice) as token ids with
# `echo: true, logprobs: 1, max_tokens: 1` and sums the choice tokens' prompt logprobs,
# exactly as it scores MMLU/HellaSwag/ARC against vLLM.  Nothing is downloaded but the
# model (once) and lm-eval (once, into its own virtualenv).
#
#   scripts/lm_eval_loglikelihood.sh                 # SmolLM2-135M-Instruct (Q4_1 GGUF, tests/real_model.py)
#   MODEL=/path/to/hf_folder scripts/lm_eval_loglikelihood.sh
#   LIMIT=8 scripts/lm_eval_loglikelihood.sh         # first 8 questions only
#
# lm-eval 0.4.13 goes into $LM_EVAL_VENV (default ~/.cache/strata-jax/client-venvs/lm-eval,
# created with --system-site-packages so it reuses torch/transformers); the environment the
# tests run in is never touched.  Prints acc / acc_norm; exits non-zero if lm-eval fails.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
LM_EVAL_VENV="${LM_EVAL_VENV:-$HOME/.cache/strata-jax/client-venvs/lm-eval}"
NAME="${SERVED_MODEL_NAME:-strata-mc}"
OUT="${OUT:-$(mktemp -d -t strata-lm-eval-ll.XXXXXX)}"
mkdir -p "$OUT"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

MODEL="${MODEL:-$(cd "$REPO" && "$PYTHON" tests/real_model.py | sed -n 1p)}"  # its first line: SmolLM2

if [[ ! -x "$LM_EVAL_VENV/bin/lm_eval" ]]; then
    log "creating $LM_EVAL_VENV (pip install lm-eval[api]==0.4.13)"
    "$PYTHON" -m venv --system-site-packages "$LM_EVAL_VENV"
    "$LM_EVAL_VENV/bin/python" -m pip install --quiet "lm-eval[api]==0.4.13" >&2
fi

# lm-eval tokenizes (question, choice) itself: it needs a Hugging Face tokenizer folder.
TOKENIZER="$MODEL"
if [[ -f "$MODEL" ]]; then
    TOKENIZER="$OUT/tokenizer"
    "$PYTHON" - "$MODEL" "$TOKENIZER" <<'PY'
import os, sys
from transformers import AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)).save_pretrained(out)
PY
fi

TASK_DIR="$OUT/tasks"
mkdir -p "$TASK_DIR"
sed "s|@DATA_FILE@|$REPO/scripts/lm_eval_loglikelihood_task/questions.jsonl|" \
    "$REPO/scripts/lm_eval_loglikelihood_task/strata_mc.yaml.in" >"$TASK_DIR/strata_mc.yaml"

PORT="$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")"
log "starting strata-jax serve --model $MODEL on 127.0.0.1:$PORT (log: $OUT/server.log)"
(cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m serving.cli serve \
    --model "$MODEL" --served-model-name "$NAME" --port "$PORT" --no-grpc ${SERVE_FLAGS:-}) \
    >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM $SERVER_PID 2>/dev/null || true; wait $SERVER_PID 2>/dev/null || true' EXIT
t0=$SECONDS
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    kill -0 "$SERVER_PID" 2>/dev/null || { log "the server exited:"; tail -20 "$OUT/server.log" >&2; exit 1; }
    (( SECONDS - t0 < ${STRATA_SERVER_START_TIMEOUT_S:-900} )) || { log "server not ready"; exit 1; }
    sleep 2
done
log "server ready after $((SECONDS - t0)) s; lm_eval --model local-completions --tasks strata_mc (results: $OUT)"

HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$LM_EVAL_VENV/bin/lm_eval" \
    --model local-completions \
    --model_args "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$TOKENIZER,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=${CONCURRENCY:-2},max_retries=1" \
    --include_path "$TASK_DIR" --tasks strata_mc --batch_size 1 \
    ${LIMIT:+--limit "$LIMIT"} \
    --output_path "$OUT/results" | tee "$OUT/lm_eval.txt"
curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E '^strata_requests_total\{' | tee "$OUT/requests.txt" >&2 || true
if grep -E 'status="(error|abort)"' "$OUT/requests.txt" | grep -v ' 0.0$' >/dev/null; then
    log "FAILED: some requests did not finish normally"; exit 1
fi
