#!/usr/bin/env bash
# A streaming load generator on the chat endpoint of `strata-jax serve`, the way users load-test
# vLLM / SGLang: NVIDIA aiperf 0.13 (`aiperf profile --endpoint-type chat --streaming`), synthetic
# prompts of a fixed length, several concurrent streams.  It must end with 0 errors.
#
#   scripts/load_chat.sh                        # the real model (SmolLM2-135M-Instruct GGUF, fetched once)
#   MODEL=/path/to/hf_folder CONCURRENCY=8 REQUESTS=100 scripts/load_chat.sh
#
# aiperf is installed on first use into its own virtualenv ($STRATA_CLIENTS_VENV_DIR/aiperf,
# default ~/.cache/strata-jax/client-venvs), never into the environment the tests run in.
# aiperf counts tokens with the model's tokenizer: a GGUF's is written out as a HF folder first.
# HF_HUB_OFFLINE is unset for aiperf: 0.13 fails to load a local tokenizer folder with it set
# (its own bug; nothing is downloaded, the tokenizer is a local folder).
source "$(dirname "${BASH_SOURCE[0]}")/chat_clients_common.sh"

MODEL="${MODEL:-$(default_model)}"
NAME="${SERVED_MODEL_NAME:-strata-chat}"
CONCURRENCY="${CONCURRENCY:-4}"
REQUESTS="${REQUESTS:-48}"
INPUT_TOKENS="${INPUT_TOKENS:-128}"
OUTPUT_TOKENS="${OUTPUT_TOKENS:-32}"
OUT="${OUT:-$(mktemp -d -t strata-load.XXXXXX)}"
mkdir -p "$OUT"
VENV="$(client_venv aiperf "aiperf==0.13.0")"
TOKENIZER="$(tokenizer_folder "$MODEL" "$OUT/tokenizer")"

start_server "$MODEL" "$NAME" "$OUT/server.log" ${SERVE_FLAGS:-}
log "aiperf profile: $REQUESTS streamed chat requests, concurrency $CONCURRENCY, ${INPUT_TOKENS} in / ${OUTPUT_TOKENS} out tokens (artifacts: $OUT)"
env -u HF_HUB_OFFLINE "$VENV/bin/aiperf" profile \
    --model-names "$NAME" --url "$SERVER_URL" --endpoint-type chat --streaming \
    --tokenizer "$TOKENIZER" \
    --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --warmup-request-count "$CONCURRENCY" \
    --prompt-input-tokens-mean "$INPUT_TOKENS" --prompt-input-tokens-stddev 0 \
    --prompt-output-tokens-mean "$OUTPUT_TOKENS" --prompt-output-tokens-stddev 0 \
    --extra-inputs ignore_eos:true \
    --random-seed 0 --ui-type simple --artifact-dir "$OUT/aiperf" | tee "$OUT/aiperf.txt"
log "requests by outcome on the server:"
request_counts "$SERVER_URL" | tee "$OUT/requests.txt" >&2
if grep -E 'status="(rejected|error|cancelled|abort)"' "$OUT/requests.txt" >/dev/null; then
    log "FAILED: some requests did not finish normally"; exit 1
fi
