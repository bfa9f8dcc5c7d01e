#!/usr/bin/env bash
# lm-evaluation-harness against `strata-jax serve`, the way users point it at vLLM / SGLang:
# the `local-chat-completions` model over /v1/chat/completions with --apply_chat_template, on
# a small local generation task (scripts/lm_eval_task/: 32 "capital of X?" questions; nothing
# is downloaded but the model, once).
#
#   scripts/lm_eval_chat.sh                     # the real model (SmolLM2-135M-Instruct GGUF, fetched once)
#   MODEL=/path/to/hf_folder scripts/lm_eval_chat.sh
#   LIMIT=8 scripts/lm_eval_chat.sh             # first 8 questions only
#
# lm-eval 0.4.13 is installed on first use into its own virtualenv
# ($STRATA_CLIENTS_VENV_DIR/lm-eval, default ~/.cache/strata-jax/client-venvs; it reuses the
# installed torch/transformers), never into the environment the tests run in.  Prints the
# scores and the server's per-outcome request counts; exits non-zero if any request failed.
source "$(dirname "${BASH_SOURCE[0]}")/chat_clients_common.sh"

MODEL="${MODEL:-$(default_model)}"
NAME="${SERVED_MODEL_NAME:-strata-chat}"
CONCURRENCY="${CONCURRENCY:-4}"
OUT="${OUT:-$(mktemp -d -t strata-lm-eval.XXXXXX)}"
mkdir -p "$OUT"
VENV="$(VENV_SYSTEM_SITE=1 client_venv lm-eval "lm-eval[api]==0.4.13")"

TASK_DIR="$OUT/tasks"
mkdir -p "$TASK_DIR"
sed "s|@DATA_FILE@|$REPO/scripts/lm_eval_task/capitals.jsonl|" "$REPO/scripts/lm_eval_task/strata_capitals.yaml.in" >"$TASK_DIR/strata_capitals.yaml"
cp "$REPO/scripts/lm_eval_task/capitals_metrics.py" "$TASK_DIR/"

start_server "$MODEL" "$NAME" "$OUT/server.log" ${SERVE_FLAGS:-}
log "lm_eval --model local-chat-completions --apply_chat_template --tasks strata_capitals (results: $OUT)"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$VENV/bin/lm_eval" run \
    --model local-chat-completions \
    --model_args "model=$NAME,base_url=$SERVER_URL/v1/chat/completions,num_concurrent=$CONCURRENCY,max_retries=1,tokenized_requests=False" \
    --apply_chat_template \
    --include_path "$TASK_DIR" --tasks strata_capitals \
    ${LIMIT:+--limit "$LIMIT"} \
    --log_samples --output_path "$OUT/results" | tee "$OUT/lm_eval.txt"
log "requests by outcome on the server:"
request_counts "$SERVER_URL" | tee "$OUT/requests.txt" >&2
if grep -E 'status="(rejected|error|cancelled|abort)"' "$OUT/requests.txt" >/dev/null; then
    log "FAILED: some requests did not finish normally"; exit 1
fi
