#!/usr/bin/env bash
# An agent framework against `strata-jax serve`: the OpenAI Agents SDK (openai-agents 0.24.0, its
# OpenAIChatCompletionsModel) runs a two-tool loop to the end on the real model; every turn after the
# first must report cached prompt tokens (scripts/agent_loop.py says what it checks).
#
#   scripts/agent_loop.sh                  # the real model (SmolLM2-135M-Instruct GGUF, fetched once)
#   MODEL=/path/to/hf_folder scripts/agent_loop.sh
#
# The SDK is installed on first use into its own virtualenv ($STRATA_CLIENTS_VENV_DIR/openai-agents,
# default ~/.cache/strata-jax/client-venvs), never into the environment the tests run in.
source "$(dirname "${BASH_SOURCE[0]}")/chat_clients_common.sh"

MODEL="${MODEL:-$(default_model)}"
NAME="${SERVED_MODEL_NAME:-strata-agent}"
OUT="${OUT:-$(mktemp -d -t strata-agent.XXXXXX)}"
mkdir -p "$OUT"
VENV="$(client_venv openai-agents "openai-agents==0.24.0")"

start_server "$MODEL" "$NAME" "$OUT/server.log" ${SERVE_FLAGS:-}
log "running the agent (OpenAI Agents SDK) against $SERVER_URL"
"$VENV/bin/python" "$REPO/scripts/agent_loop.py" "$SERVER_URL/v1" "$NAME" | tee "$OUT/agent.txt"
