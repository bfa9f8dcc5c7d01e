#!/usr/bin/env bash
# lm-evaluation-harness accuracy with the KV of a long shared prefix read back from a quantized
# L2 (issue 20: "the local lm-eval multiple-choice task's accuracy within 2 points").
#
# The task (scripts/lm_eval_tier_task/, 64 questions): every prompt is the same ~870-token
# many-shot block followed by one question with four choices; lm-eval `local-completions`
# sends it to /v1/completions (token ids, greedy, stop at the newline) and scores the answer
# by exact match.  For each format in $FORMATS, `strata-jax serve --tiers L1+L2
# --kv-tier-format FMT` runs behind a small proxy (written by this script) that, before each
# completion, empties L1 (`POST /admin/flush_cache {"tier": "device"}`) and serializes the
# requests: the first question computes the block and writes it through to L2, every later
# one loads the block's pages back from L2 -- in FMT -- and computes only its own question.
# (The loglikelihood task of lm_eval_loglikelihood.sh cannot show this: prompt-logprob
# requests bypass the prefix cache.)  The proxy logs each response's
# usage.cached_tokens_per_tier; the run fails if any question after the first did not get
# the block's full pages from L2 (host tier), or if /admin/cache_stats disagrees.
#
#   scripts/lm_eval_tiers.sh                          # full fp8 int8, SmolLM2-135M-Instruct (tests/real_model.py)
#   FORMATS="full int8" LIMIT=16 scripts/lm_eval_tiers.sh
#   MODEL=/path/to/model SERVE_FLAGS="--page-size 32" MAX_DELTA_POINTS=2 scripts/lm_eval_tiers.sh
#
# Prints a table (format, exact match, questions, prompt tokens loaded from L2, answers that
# differ from full's, difference in points vs full) and exits non-zero if any format's
# accuracy differs from full's by more than $MAX_DELTA_POINTS (default 2) points.  lm-eval
# 0.4.13 lives in its own virtualenv (~/.cache/strata-jax/client-venvs/lm-eval, as for
# lm_eval_chat.sh / lm_eval_loglikelihood.sh); nothing else is downloaded.
source "$(dirname "${BASH_SOURCE[0]}")/chat_clients_common.sh"

FORMATS="${FORMATS:-full fp8 int8}"
MODEL="${MODEL:-$(cd "$REPO" && "$PYTHON" tests/real_model.py | sed -n 1p)}"  # its first line: SmolLM2
NAME="${SERVED_MODEL_NAME:-strata-tiers}"
MAX_DELTA_POINTS="${MAX_DELTA_POINTS:-2}"
OUT="${OUT:-$(mktemp -d -t strata-lm-eval-tiers.XXXXXX)}"
mkdir -p "$OUT"
TASK_SRC="$REPO/scripts/lm_eval_tier_task"
VENV="$(VENV_SYSTEM_SITE=1 client_venv lm-eval "lm-eval[api]==0.4.13")"
TOKENIZER="$(tokenizer_folder "$MODEL" "$OUT/tokenizer")"

TASK_DIR="$OUT/tasks"
mkdir -p "$TASK_DIR"
sed "s|@DATA_FILE@|$TASK_SRC/questions.jsonl|" "$TASK_SRC/strata_tier_mc.yaml.in" >"$TASK_DIR/strata_tier_mc.yaml"
cp "$TASK_SRC/tier_task.py" "$TASK_SRC/shots.jsonl" "$TASK_DIR/"

PREFIX_TOKENS="$("$PYTHON" - "$TOKENIZER" "$TASK_DIR" <<'PY'
import sys
from transformers import AutoTokenizer
sys.path.insert(0, sys.argv[2])
import tier_task
print(len(AutoTokenizer.from_pretrained(sys.argv[1]).encode(tier_task.PREFIX, add_special_tokens=False)))
PY
)"
log "shared prefix: $PREFIX_TOKENS tokens; formats: $FORMATS; results under $OUT"

# The proxy in front of the server: flush L1, then forward; one completion at a time.
cat >"$OUT/flush_proxy.py" <<'PY'
import http.client, json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

upstream, port, log_path = urlsplit(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
lock = threading.Lock()


def forward(method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=900)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", "application/json"), resp.read()
    finally:
        conn.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, status, ctype, data):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply(*forward("GET", self.path))

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
        if not self.path.startswith("/v1/completions"):
            return self.reply(*forward("POST", self.path, body, headers))
        with lock:
            auth = {"Authorization": headers["Authorization"]} if "Authorization" in headers else {}
            status, ctype, data = forward("POST", "/admin/flush_cache", b'{"tier": "device"}', {"Content-Type": "application/json", **auth})
            if status != 200:
                return self.reply(502, ctype, data)
            status, ctype, data = forward("POST", self.path, body, headers)
            try:
                usage = json.loads(data).get("usage") or {}
            except ValueError:
                usage = {}
            with open(log_path, "a") as f:
                f.write(json.dumps({"status": status, "prompt_tokens": usage.get("prompt_tokens"),
                                    "cached_tokens_per_tier": usage.get("cached_tokens_per_tier")}) + "\n")
        self.reply(status, ctype, data)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
PY

PROXY_PID=""
stop_proxy() { if [[ -n "$PROXY_PID" ]]; then kill -TERM "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true; fi; PROXY_PID=""; }

t_all=$SECONDS
for fmt in $FORMATS; do
    RUN="$OUT/$fmt"
    mkdir -p "$RUN"
    t_fmt=$SECONDS
    start_server "$MODEL" "$NAME" "$RUN/server.log" --tiers L1+L2 --kv-tier-format "$fmt" ${SERVE_FLAGS:-}
    trap 'stop_proxy; stop_server' EXIT
    curl -sf "$SERVER_URL/admin/cache_stats" >"$RUN/cache_stats_before.json"
    PROXY_PORT="$(free_port)"
    "$PYTHON" "$OUT/flush_proxy.py" "$SERVER_URL" "$PROXY_PORT" "$RUN/requests.jsonl" 2>"$RUN/proxy.log" &
    PROXY_PID=$!
    until curl -sf "http://127.0.0.1:$PROXY_PORT/health" >/dev/null 2>&1; do
        kill -0 "$PROXY_PID" 2>/dev/null || { log "the proxy exited:"; cat "$RUN/proxy.log" >&2; exit 1; }
        sleep 0.2
    done
    log "[$fmt] lm_eval --model local-completions --tasks strata_tier_mc (L1 flushed before each question)"
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/lm_eval" run \
        --model local-completions \
        --model_args "model=$NAME,base_url=http://127.0.0.1:$PROXY_PORT/v1/completions,tokenizer=$TOKENIZER,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
        --include_path "$TASK_DIR" --tasks strata_tier_mc --batch_size 1 \
        ${LIMIT:+--limit "$LIMIT"} \
        --log_samples --output_path "$RUN/results" >"$RUN/lm_eval.txt" 2>"$RUN/lm_eval.log" \
        || { log "[$fmt] lm_eval failed:"; tail -20 "$RUN/lm_eval.log" >&2; exit 1; }
    grep -E '^\|' "$RUN/lm_eval.txt" >&2 || true
    curl -sf "$SERVER_URL/admin/cache_stats" >"$RUN/cache_stats_after.json"
    curl -sf "$SERVER_URL/metrics" | grep -E '^strata_(requests_total|request_cached_tokens_total)\{' >"$RUN/metrics.txt" || true
    stop_proxy
    stop_server
    # Fail loudly unless every question after the first got the prefix's full pages from L2.
    "$PYTHON" - "$RUN" "$PREFIX_TOKENS" <<'PY' || exit 1
import json, sys
from pathlib import Path
run, prefix = Path(sys.argv[1]), int(sys.argv[2])
rows = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
before, after = (json.loads((run / f"cache_stats_{w}.json").read_text()) for w in ("before", "after"))
page = after["device_pool"]["page_size"]
need = prefix // page * page  # the block's full pages (a partial page is recomputed)
# after the first question: the block's full pages from the host tier, nothing from L1 (flushed)
bad = [i for i, r in enumerate(rows) if r["status"] != 200
       or (i > 0 and (r["cached_tokens_per_tier"]["host"] < need or r["cached_tokens_per_tier"]["device"] > 0))]
host = sum(r["cached_tokens_per_tier"]["host"] for r in rows if r["status"] == 200)
stats_host = after["hit_tokens"].get("host", 0) - before["hit_tokens"].get("host", 0)
print(f"[{run.name}] {len(rows)} requests; prompt tokens from L2 (host): {host} "
      f"({host // max(len(rows) - 1, 1)} per question after the first; the prefix's full pages: {need}); "
      f"/admin/cache_stats hit_tokens.host +{stats_host}, loaded pages +"
      f"{after['transfers']['loaded_pages'] - before['transfers']['loaded_pages']}, L1 hits "
      f"{sum(r['cached_tokens_per_tier']['device'] for r in rows if r['status'] == 200)}", file=sys.stderr)
if len(rows) < 2 or bad or stats_host != host:
    sys.exit(f"[{run.name}] FAILED: the shared prefix did not come from L2 "
             f"(requests {bad[:10]}: {[rows[i] for i in bad[:3]]}; proxy {host} vs cache_stats {stats_host})")
(run / "l2.json").write_text(json.dumps({"host_tokens": host, "requests": len(rows), "prefix_page_tokens": need}))
PY
    log "[$fmt] done in $((SECONDS - t_fmt)) s"
done

"$PYTHON" - "$OUT" "$MAX_DELTA_POINTS" $FORMATS <<'PY'
import json, sys
from pathlib import Path
out, max_delta, formats = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
rows = {}
for fmt in formats:
    res = json.loads(sorted((out / fmt / "results").rglob("results_*.json"))[-1].read_text())["results"]["strata_tier_mc"]
    samples = [json.loads(line) for line in sorted((out / fmt / "results").rglob("samples_strata_tier_mc_*.jsonl"))[-1].read_text().splitlines()]
    rows[fmt] = {"acc": res["exact_match,none"], "valid": res["valid_choice,none"],
                 "answers": {s["doc_id"]: s["filtered_resps"][0] for s in samples}} | json.loads((out / fmt / "l2.json").read_text())
ref = rows.get("full")
print(f"\n{'format':<7} {'exact match':>11} {'valid choice':>12} {'questions':>9} {'L2 tokens':>9} {'changed vs full':>15} {'delta (points)':>14}")
failed = []
for fmt, r in rows.items():
    n = len(r["answers"])
    changed = sum(r["answers"][d] != ref["answers"].get(d) for d in r["answers"]) if ref else None
    delta = 100 * (r["acc"] - ref["acc"]) if ref else None
    if delta is not None and abs(delta) > max_delta + 1e-9:
        failed.append(fmt)
    print(f"{fmt:<7} {r['acc']:>11.4f} {r['valid']:>12.4f} {n:>9} {r['host_tokens']:>9} "
          f"{'n/a' if changed is None else changed:>15} {'n/a' if delta is None else format(delta, '+.2f'):>14}")
(out / "summary.json").write_text(json.dumps(rows, indent=1))
if ref is None:
    print("(no 'full' run: no reference to compare with)")
if failed:
    sys.exit(f"FAILED: accuracy of {failed} differs from full by more than {max_delta} points")
print(f"every format within {max_delta} points of full")
PY
log "total $((SECONDS - t_all)) s (results: $OUT)"
