#!/usr/bin/env python3
"""Soak: mixed traffic against a real ``strata-jax serve`` with faults injected on a schedule.

    python scripts/soak.py                       # 30 minutes
    python scripts/soak.py --minutes 5 --json /tmp/soak.json
    python scripts/soak.py --minutes 3 --keep-dir   # keep the server log and the L3 directory

The script starts ``python -m serving.cli serve --model tiny --tiers L1+L2+L3`` on 127.0.0.1 (a
free port unless ``--port``) with a fresh ``--storage-dir`` in a temporary folder, waits for it
to be ready, then for ``--minutes`` runs:

* **traffic**: ``--clients`` threads (default 6), each a loop bounded in count and time, sending
  a mix of shared-prefix document questions (6 documents of ~1,100-1,450 tokens cut from the
  LooGLE excerpt in ``strata_jax/demo_data``, short questions, greedy, 8-24 tokens out) as
  completions and chat completions, multi-turn chats, streaming and non-streaming, some with
  ``n=2`` (sampled, seeded), only to 127.0.0.1;
* **client hang-ups**: streams closed after a random number of chunks (0 = right after the
  headers), and non-streaming requests given up after a random 0.05-2 s;
* **storage faults**: every ~10 s a few L3 objects (``STORAGE_DIR/objects/*/*.kv``) are bit-flipped,
  truncated, emptied, overwritten with another object or deleted; every ~90 s the L3 temp directory
  is replaced by a plain file for 10 s, so every L3 write fails (this works as root, where a
  ``chmod`` would not);
* **flushes**: every minute the clients pause, the server drains, ``POST /flush_cache`` (L1+L2)
  empties the local tiers, the post-flush cache figures are read, the greedy probe is asked twice
  (from L3 or recomputed, then from L1) and traffic resumes; half-way between two of those, a
  flush under load (``POST /admin/flush_cache`` with tier ``device``, ``host`` or ``all`` in turn);
* **samples** every ~10 s: the server's RSS and threads (``/proc/PID/status``) and ``/admin/cache_stats``
  (host and device pool pages, locked nodes, storage figures); a progress line every 30 s.

At the end: the server is drained and flushed, ``GET /admin/check_accounting`` is asked (when the
server has such a route), then SIGTERM; it must exit 0.

Checks (exit code 1 when one fails; each is printed, and kept with every figure by ``--json``):
no 5xx at all (no injected fault may produce one: a corrupt or missing L3 object is a miss), no
unexpected 4xx, no transport error other than the hang-ups we made, no in-band stream error, every
answer well formed; the probe's tokens equal its first answer at every check (drained and under
load); RSS flat after the warm-up (the first ``--warmup-fraction``, 20%, of the run: the median of
the last three samples within ``--rss-tolerance``, 5%, of the first three; max/min is reported);
the host pool after every drained flush back to its first post-flush value; nothing locked,
running or waiting when drained; the accounting route (when present) clean; the server alive
until the end and exiting 0 on SIGTERM.  Tracebacks in the server log are counted and reported.

Standard library plus ``httpx`` (a dependency of the serve extra).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
EXCERPT = REPO / "strata_jax" / "demo_data" / "loogle_picardo.json"
HOST = "127.0.0.1"
N_DOCS = 6
PROBE_QUESTION = "In one sentence, what is this text about?"
PROBE_TOKENS = 24
QUESTIONS = (
    "Who is the text about?",
    "Summarise the first paragraph.",
    "Which places are named?",
    "What happened first?",
    "Give one date from the text.",
    "What is the main event?",
    "Name one person other than the subject.",
    "What is the tone of the text?",
)
CHAT_OPENERS = (
    "Hello! Can you help me plan a short trip?",
    "Tell me a fact about the sea.",
    "What is a good name for a cat?",
    "Let us play a word game.",
)
CHAT_FOLLOW_UPS = ("Go on.", "Why?", "Can you say that more simply?", "And then?", "Thanks. Another one?")
# the traffic mix: kind -> weight
MIX = {
    "doc_completion": 28,
    "doc_chat": 24,
    "multi_turn": 20,
    "n2": 10,
    "hangup_stream": 12,
    "hangup_plain": 6,
}
# tiny-model serve flags: a small L1 and L2 (so documents spill to L3 and come back from it), short contexts
SERVE_FLAGS = [
    "--tiers",
    "L1+L2+L3",
    "--hicache-ratio",
    "2",
    "--max-batch-tokens",
    "256",
    "--max-batch-size",
    "8",
    "--max-context-tokens",
    "2048",
    "--show-progress",
    "false",
    "--log-level",
    "warning",
    "--no-grpc",
]
REQUEST_TIMEOUT_S = 300.0
INBAND_5XX = ("internal_error", "service_unavailable")  # serving/http_server.py map_error: 500, 503
MAX_REQUESTS_PER_CLIENT = 100_000


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def documents() -> tuple[list[str], list[str]]:
    """``N_DOCS`` documents of ~1,100-1,500 bytes (= tiny-model tokens) cut at word boundaries,
    and questions (the excerpt's own first, then generic ones)."""
    data = json.loads(EXCERPT.read_text())
    words = data["text"].split()
    docs: list[str] = []
    i = 0
    for d in range(N_DOCS):
        target = 1100 + 350 * d // max(1, N_DOCS - 1)  # 1,100 .. 1,450 bytes (+ the last word)
        out: list[str] = []
        size = 0
        while size < target:
            w = words[i % len(words)]
            out.append(w)
            size += len(w) + 1
            i += 1
        docs.append(f"Document {d + 1}.\n" + " ".join(out))
    questions = [qa.get("question") or qa.get("Q") or "" for qa in data.get("qa", []) if isinstance(qa, dict)]
    questions = [q for q in questions if 0 < len(q) < 200] + list(QUESTIONS)
    return docs, questions


# --------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------


class Server:
    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.port = args.port or free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.storage_dir = workdir / "l3"
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.model = "tiny"

    def start(self) -> float:
        xla_cache = self.args.xla_cache or os.path.join(tempfile.gettempdir(), "strata_soak_xla_cache")
        cmd = [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "serving.cli",
            "serve",
            "--model",
            "tiny",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--storage-dir",
            str(self.storage_dir),
            "--compilation-cache-dir",
            xla_cache,
            "--device-tokens",
            str(self.args.device_tokens),
            *SERVE_FLAGS,
            *self.args.serve_flags.split(),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        log(f"starting {' '.join(cmd)} (log: {self.log_path})")
        t0 = time.monotonic()
        with self.log_path.open("w") as fh:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited during start-up (code {self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > self.args.start_timeout:
                self.stop(10)
                raise SystemExit(f"the server was not ready after {self.args.start_timeout} s:\n{self.log_tail()}")
            time.sleep(1)
        self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        ready_s = time.monotonic() - t0
        log(f"ready after {ready_s:.0f} s (pid {self.proc.pid}, model {self.model!r})")
        return ready_s

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def proc_status(self) -> dict[str, int]:
        """VmRSS (bytes) and Threads of the server process, from ``/proc/PID/status``."""
        out: dict[str, int] = {}
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:  # type: ignore[union-attr]
                for line in f:
                    if line.startswith("VmRSS:"):
                        out["rss"] = int(line.split()[1]) * 1024
                    elif line.startswith("Threads:"):
                        out["threads"] = int(line.split()[1])
        except (OSError, ValueError, AttributeError):
            pass
        return out

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, wait up to ``timeout``; SIGKILL after.  The exit code of a SIGTERM'd exit (None if killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            return self.proc.returncode
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGABRT)  # faulthandler writes the stacks into the log
            time.sleep(2)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            return None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def error_lines(self, n: int = 20) -> list[str]:
        """The log's first ``n`` ERROR lines (what a failed check's report needs: the server's own words)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line[:500] for line in lines if " ERROR " in line][:n]

    def tracebacks(self) -> list[str]:
        """Each traceback in the log: the line before it (the log message) and its last line."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        out = []
        for i, line in enumerate(lines):
            if line.startswith("Traceback (most recent call last)"):
                j = i + 1
                while j < len(lines) and (
                    lines[j].startswith(" ") or lines[j].startswith("Traceback") or not lines[j].strip()
                ):
                    j += 1
                last = lines[j] if j < len(lines) else ""
                before = lines[i - 1] if i else ""
                out.append(f"{before.strip()[:200]} | {last.strip()[:300]}")
        return out


# --------------------------------------------------------------------------------------------
# accounting of what was sent and answered
# --------------------------------------------------------------------------------------------


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    answered: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    hangups: Counter = field(default_factory=Counter)  # what we closed on purpose: stream / plain
    transport_errors: Counter = field(default_factory=Counter)  # not made by us
    inband_errors: Counter = field(default_factory=Counter)  # error events inside a 200 stream
    bad_answers: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    cached_tokens: Counter = field(default_factory=Counter)  # per tier
    examples: list = field(default_factory=list)  # a few failures, for the report

    def note(self, what: str) -> None:
        with self.lock:
            if len(self.examples) < 20:
                self.examples.append(what[:500])

    def status(self, code: int) -> None:
        with self.lock:
            self.answered += 1
            self.by_status[str(code)] += 1

    def fives(self) -> int:
        """5xx statuses plus in-band stream errors of the 5xx kinds (a stream's status is sent before them)."""
        return sum(n for code, n in self.by_status.items() if code.startswith("5")) + sum(
            n for kind, n in self.inband_errors.items() if kind in INBAND_5XX
        )

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "sent": self.sent,
                "answered": self.answered,
                "by_status": dict(self.by_status),
                "by_kind": dict(self.by_kind),
                "hangups": dict(self.hangups),
                "transport_errors": dict(self.transport_errors),
                "inband_errors": dict(self.inband_errors),
                "bad_answers": self.bad_answers,
                "finish_reasons": dict(self.finish_reasons),
                "cached_tokens_per_tier": dict(self.cached_tokens),
                "examples": list(self.examples),
            }


# --------------------------------------------------------------------------------------------
# traffic
# --------------------------------------------------------------------------------------------


class Gate:
    """Clients wait on it between requests; the flusher closes it and waits for zero in flight."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.cv = threading.Condition()
        self.in_flight = 0

    def enter(self, stop: threading.Event) -> bool:
        while not stop.is_set():
            if self.open.wait(0.5):
                with self.cv:
                    if self.open.is_set():
                        self.in_flight += 1
                        return True
        return False

    def leave(self) -> None:
        with self.cv:
            self.in_flight -= 1
            self.cv.notify_all()

    def close_and_drain(self, timeout: float) -> bool:
        self.open.clear()
        with self.cv:
            return self.cv.wait_for(lambda: self.in_flight == 0, timeout)


class Client(threading.Thread):
    def __init__(self, idx: int, soak: Soak):
        super().__init__(name=f"client-{idx}", daemon=True)
        self.idx, self.soak = idx, soak
        self.rng = random.Random(soak.args.seed * 1000 + idx)
        self.http = httpx.Client(base_url=soak.server.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30))
        self.conversation: list[dict] = []

    def run(self) -> None:
        s = self.soak
        kinds, weights = list(MIX), list(MIX.values())
        try:
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if time.monotonic() >= s.deadline or not s.gate.enter(s.stop):
                    return
                try:
                    kind = self.rng.choices(kinds, weights)[0]
                    with s.tally.lock:
                        s.tally.sent += 1
                        s.tally.by_kind[kind] += 1
                    getattr(self, kind)()
                except Exception as exc:  # a bug of ours: count it, go on
                    s.tally.note(f"client {self.idx}: {type(exc).__name__}: {exc}")
                    with s.tally.lock:
                        s.tally.transport_errors[f"client:{type(exc).__name__}"] += 1
                finally:
                    s.gate.leave()
        finally:
            self.http.close()

    # ---- request bodies ----------------------------------------------------------------
    def _doc(self) -> tuple[str, str]:
        docs, questions = self.soak.docs, self.soak.questions
        return self.rng.choice(docs), self.rng.choice(questions)

    def _completion_body(self, stream: bool, n: int = 1) -> dict:
        doc, q = self._doc()
        body: dict = {
            "model": self.soak.server.model,
            "prompt": f"{doc}\n\nQuestion: {q}\nAnswer:",
            "max_tokens": self.rng.randint(8, 24),
            "temperature": 0,
            "stream": stream,
        }
        if n > 1:
            body.update(n=n, temperature=0.8, seed=self.rng.randrange(1 << 30))
        return body

    def _chat_body(self, stream: bool, n: int = 1) -> dict:
        doc, q = self._doc()
        body: dict = {
            "model": self.soak.server.model,
            "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}],
            "max_tokens": self.rng.randint(8, 24),
            "temperature": 0,
            "stream": stream,
        }
        if n > 1:
            body.update(n=n, temperature=0.8, seed=self.rng.randrange(1 << 30))
        return body

    # ---- kinds ---------------------------------------------------------------------------
    def doc_completion(self) -> None:
        stream = self.rng.random() < 0.5
        self.send("/v1/completions", self._completion_body(stream))

    def doc_chat(self) -> None:
        stream = self.rng.random() < 0.5
        self.send("/v1/chat/completions", self._chat_body(stream))

    def n2(self) -> None:
        stream = self.rng.random() < 0.5
        if self.rng.random() < 0.5:
            self.send("/v1/completions", self._completion_body(stream, n=2), n=2)
        else:
            self.send("/v1/chat/completions", self._chat_body(stream, n=2), n=2)

    def multi_turn(self) -> None:
        if (
            not self.conversation
            or len(self.conversation) > 11
            or sum(len(m["content"]) for m in self.conversation) > 1200
        ):
            self.conversation = [
                {"role": "system", "content": f"You are assistant number {self.idx}. Be brief."},
                {"role": "user", "content": self.rng.choice(CHAT_OPENERS)},
            ]
        else:
            self.conversation.append({"role": "user", "content": self.rng.choice(CHAT_FOLLOW_UPS)})
        stream = self.rng.random() < 0.5
        body = {
            "model": self.soak.server.model,
            "messages": list(self.conversation),
            "max_tokens": self.rng.randint(8, 32),
            "temperature": 0,
            "stream": stream,
        }
        text = self.send("/v1/chat/completions", body)
        if text is None:
            self.conversation = []
        else:
            self.conversation.append({"role": "assistant", "content": text})

    def hangup_stream(self) -> None:
        """A stream closed after a random number of events (0: right after the headers)."""
        if self.rng.random() < 0.5:
            path, body = "/v1/completions", self._completion_body(True, n=2 if self.rng.random() < 0.2 else 1)
        else:
            path, body = "/v1/chat/completions", self._chat_body(True)
        body["max_tokens"] = 32
        cut = self.rng.randint(0, 12)
        self.send(path, body, cut_after=cut, n=body.get("n", 1))

    def hangup_plain(self) -> None:
        """A non-streaming request given up after 0.05-2 s (the connection is closed)."""
        path, body = (
            ("/v1/completions", self._completion_body(False))
            if self.rng.random() < 0.5
            else ("/v1/chat/completions", self._chat_body(False))
        )
        body["max_tokens"] = 32
        give_up = self.rng.uniform(0.05, 2.0)
        t = self.soak.tally
        try:
            with httpx.Client(base_url=self.soak.server.url, timeout=httpx.Timeout(give_up, connect=30)) as http:
                r = http.post(path, json=body)
        except httpx.TimeoutException:
            with t.lock:
                t.hangups["plain"] += 1
            return
        except httpx.HTTPError as exc:
            self._transport_error(path, exc)
            return
        self._check_plain(path, body, r, 1)

    # ---- sending and checking ----------------------------------------------------------------
    def _transport_error(self, path: str, exc: BaseException) -> None:
        t = self.soak.tally
        with t.lock:
            t.transport_errors[type(exc).__name__] += 1
        t.note(f"{path}: {type(exc).__name__}: {exc}")

    def send(self, path: str, body: dict, *, cut_after: int | None = None, n: int = 1) -> str | None:
        """Send; count the status and check the answer.  The text of choice 0 (None on a failure)."""
        try:
            if body.get("stream"):
                return self._stream(path, body, cut_after, n)
            r = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            self._transport_error(path, exc)
            self.http.close()  # a fresh pool: the failed connection is not reused
            self.http = httpx.Client(
                base_url=self.soak.server.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30)
            )
            return None
        return self._check_plain(path, body, r, n)

    def _check_plain(self, path: str, body: dict, r: httpx.Response, n: int) -> str | None:
        t = self.soak.tally
        t.status(r.status_code)
        if r.status_code != 200:
            t.note(f"{path} -> {r.status_code}: {r.text[:300]}")
            return None
        try:
            data = r.json()
            choices = sorted(data["choices"], key=lambda c: c["index"])
            assert [c["index"] for c in choices] == list(range(n)), f"choice indexes {[c['index'] for c in choices]}"
            texts = [
                c["text"] if path.endswith("/completions") and "chat" not in path else c["message"]["content"]
                for c in choices
            ]
            reasons = [c["finish_reason"] for c in choices]
            assert all(x in ("stop", "length") for x in reasons), f"finish reasons {reasons}"
            assert data["usage"]["completion_tokens"] <= n * body["max_tokens"], f"usage {data['usage']}"
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            with t.lock:
                t.bad_answers += 1
            t.note(f"{path}: bad answer ({exc}): {r.text[:300]}")
            return None
        self._note_usage(data.get("usage"), reasons)
        return texts[0] or ""

    def _note_usage(self, usage: dict | None, reasons: list) -> None:
        t = self.soak.tally
        with t.lock:
            for x in reasons:
                t.finish_reasons[x] += 1
            per_tier = (
                ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens_per_tier")
                or (usage or {}).get("cached_tokens_per_tier")
                or {}
            )
            for tier, v in per_tier.items():
                if isinstance(v, int):
                    t.cached_tokens[tier] += v

    def _stream(self, path: str, body: dict, cut_after: int | None, n: int) -> str | None:
        t = self.soak.tally
        chat = "chat" in path
        body = dict(body, stream_options={"include_usage": True})
        texts: dict[int, list[str]] = {}
        reasons: dict[int, str] = {}
        usage = None
        events = 0
        done = False
        try:
            http = (
                self.http
                if cut_after is None
                else httpx.Client(base_url=self.soak.server.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30))
            )
            try:
                with http.stream("POST", path, json=body) as r:
                    t.status(r.status_code)
                    if r.status_code != 200:
                        r.read()
                        t.note(f"{path} (stream) -> {r.status_code}: {r.text[:300]}")
                        return None
                    if cut_after == 0:
                        with t.lock:
                            t.hangups["stream"] += 1
                        return None
                    for line in sse_lines(r):
                        if not line.startswith("data: "):
                            continue
                        payload = line[6:]
                        if payload == "[DONE]":
                            done = True
                            break
                        event = json.loads(payload)
                        if "error" in event:
                            err = event["error"]
                            kind = err.get("type", "?") if isinstance(err, dict) else "?"
                            with t.lock:
                                t.inband_errors[kind] += 1
                            t.note(f"{path} (stream) in-band error: {payload[:300]}")
                            return None
                        if event.get("usage") and not event.get("choices"):
                            usage = event["usage"]
                        for c in event.get("choices") or []:
                            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                            texts.setdefault(c["index"], []).append(piece or "")
                            if c.get("finish_reason"):
                                reasons[c["index"]] = c["finish_reason"]
                        events += 1
                        if cut_after is not None and events >= cut_after:
                            with t.lock:
                                t.hangups["stream"] += 1
                            return None  # leaving the block closes the response: the connection is dropped
            finally:
                if http is not self.http:
                    http.close()
        except httpx.HTTPError as exc:
            self._transport_error(path + " (stream)", exc)
            self.http.close()
            self.http = httpx.Client(
                base_url=self.soak.server.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30)
            )
            return None
        if cut_after is not None:  # the stream ended before the cut: a normal answer
            pass
        problem = None
        if not done:
            problem = "no [DONE]"
        elif sorted(reasons) != list(range(n)) or not all(x in ("stop", "length") for x in reasons.values()):
            problem = f"finish reasons {reasons}"
        elif usage is None:
            problem = "no usage chunk"
        if problem:
            with t.lock:
                t.bad_answers += 1
            t.note(f"{path} (stream): bad answer: {problem}")
            return None
        self._note_usage(usage, list(reasons.values()))
        return "".join(texts.get(0, []))


def sse_lines(r: httpx.Response):
    """The stream's lines split as SSE splits them (CR LF, LF, CR only).  Not ``iter_lines``:
    httpx splits on every ``str.splitlines`` boundary, U+2028 and U+0085 included, which JSON
    leaves unescaped in a token's text (the tiny model writes arbitrary bytes)."""
    buf = b""
    for chunk in r.iter_bytes():
        buf += chunk
        while True:
            m = re.search(rb"\r\n|\n|\r", buf)
            if m is None or (m.group() == b"\r" and m.end() == len(buf)):  # a CR may be half of a CR LF
                break
            yield buf[: m.start()].decode("utf-8", errors="replace")
            buf = buf[m.end() :]
    if buf:
        yield buf.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------------------------


class StorageFaults(threading.Thread):
    """Corrupts / deletes L3 objects every ~``every`` s; makes L3 unwritable for ``outage_s``
    every ~``outage_every`` s."""

    def __init__(self, soak: Soak, every: float = 10.0, outage_every: float = 90.0, outage_s: float = 10.0):
        super().__init__(name="storage-faults", daemon=True)
        self.soak = soak
        self.rng = random.Random(soak.args.seed * 7919 + 1)
        self.every, self.outage_every, self.outage_s = every, outage_every, outage_s
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.root = soak.server.storage_dir
        self.outages: list[tuple[float, float]] = []  # (start, end) seconds since the soak began

    def objects(self) -> list[Path]:
        return list((self.root / "objects").glob("*/*.kv"))

    def corrupt_some(self) -> None:
        objs = self.objects()
        if not objs:
            self.counts["no_objects"] += 1
            return
        for path in self.rng.sample(objs, min(len(objs), self.rng.randint(1, 3))):
            action = self.rng.choice(("bitflip", "bitflip", "truncate", "empty", "swap", "delete"))
            try:
                if action == "delete":
                    path.unlink()
                elif action == "empty":
                    path.write_bytes(b"")
                elif action == "truncate":
                    size = path.stat().st_size
                    with open(path, "r+b") as f:
                        f.truncate(self.rng.randrange(max(1, size)))
                elif action == "bitflip":
                    size = path.stat().st_size
                    if size == 0:
                        continue
                    with open(path, "r+b") as f:
                        for _ in range(self.rng.randint(1, 4)):
                            pos = self.rng.randrange(size)
                            f.seek(pos)
                            b = f.read(1)
                            f.seek(pos)
                            f.write(bytes([(b[0] if b else 0) ^ (1 << self.rng.randrange(8))]))
                elif action == "swap":
                    other = self.rng.choice(objs)
                    if other == path:
                        continue
                    path.write_bytes(other.read_bytes())
                self.counts[action] += 1
            except OSError as exc:  # the server removed or replaced it meanwhile
                self.counts["raced"] += 1
                if len(self.errors) < 10:
                    self.errors.append(f"{action} {path.name}: {exc}")

    def outage(self) -> None:
        """The L3 temp directory becomes a plain file: every write fails (also as root) until it is put back."""
        tmp = self.root / "tmp"
        away = self.root / "tmp.soak-away"
        start = time.monotonic()
        try:
            os.rename(tmp, away)
            tmp.write_bytes(b"not a directory\n")
        except OSError as exc:
            self.errors.append(f"outage: {exc}")
            return
        self.counts["outage"] += 1
        self.soak.stop.wait(self.outage_s)
        try:
            tmp.unlink()
            os.rename(away, tmp)
        except OSError as exc:
            self.errors.append(f"outage end: {exc}")
            tmp.mkdir(exist_ok=True)
        for leftover in tmp.glob("*.tmp"):  # the writes caught by the outage
            try:
                leftover.unlink()
            except OSError:
                pass
        self.outages.append((round(start - self.soak.t0, 1), round(time.monotonic() - self.soak.t0, 1)))

    def run(self) -> None:
        s = self.soak
        next_outage = s.t0 + self.outage_every * self.rng.uniform(0.5, 1.0)
        while not s.stop.wait(self.every * self.rng.uniform(0.5, 1.5)):
            if time.monotonic() >= s.deadline:
                return
            self.corrupt_some()
            if time.monotonic() >= next_outage:
                self.outage()
                next_outage = time.monotonic() + self.outage_every * self.rng.uniform(0.75, 1.25)


# --------------------------------------------------------------------------------------------
# the soak
# --------------------------------------------------------------------------------------------


class Soak:
    def __init__(self, args: argparse.Namespace, server: Server):
        self.args, self.server = args, server
        self.docs, self.questions = documents()
        self.tally = Tally()
        self.gate = Gate()
        self.stop = threading.Event()
        self.duration = args.minutes * 60.0
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.duration
        self.admin = httpx.Client(base_url=server.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30))
        self.samples: list[dict] = []
        self.flushes: list[dict] = []  # drained flushes: figures right after
        self.load_flushes: list[dict] = []  # flushes under load
        self.probe_reference: dict | None = None
        self.probes: list[dict] = []
        self.admin_errors: list[str] = []
        self.faults: StorageFaults | None = None

    # ---- admin calls ----------------------------------------------------------------
    def cache_stats(self) -> dict | None:
        try:
            r = self.admin.get("/admin/cache_stats")
        except httpx.HTTPError as exc:
            self.admin_errors.append(f"cache_stats: {type(exc).__name__}: {exc}")
            return None
        self.tally_admin(r)
        return r.json() if r.status_code == 200 else None

    def tally_admin(self, r: httpx.Response) -> None:
        if r.status_code != 200:
            self.admin_errors.append(f"{r.request.method} {r.request.url.path} -> {r.status_code}: {r.text[:300]}")

    def sample(self, label: str = "") -> dict:
        now = time.monotonic() - self.t0
        s: dict[str, Any] = {"t": round(now, 1), "label": label, "rss_mb": None}
        ps = self.server.proc_status()
        if "rss" in ps:
            s["rss_mb"] = round(ps["rss"] / 2**20, 1)
        s["threads"] = ps.get("threads")
        stats = self.cache_stats()
        if stats:
            s["host_used_pages"] = stats["host_pool"]["used_pages"]
            s["host_total_pages"] = stats["host_pool"]["total_pages"]
            s["device_used_pages"] = stats["device_pool"]["used_pages"]
            s["locked_nodes"] = stats["locked_nodes"]
            s["running"] = stats["running"]
            s["waiting"] = stats["waiting"]
            s["storage_errors"] = stats["transfers"]["storage_errors"]
            st = stats.get("storage") or {}
            s["storage"] = {
                k: st.get(k) for k in ("objects", "bytes", "hits", "misses", "corrupt", "writes") if k in st
            }
        return s

    def probe(self, label: str) -> dict:
        """The fixed greedy probe (document 0 + a fixed question): its tokens (bytes of each, from logprobs)."""
        body = {
            "model": self.server.model,
            "messages": [{"role": "system", "content": self.docs[0]}, {"role": "user", "content": PROBE_QUESTION}],
            "max_tokens": PROBE_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 0,
        }
        out: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1), "label": label}
        try:
            r = self.admin.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        self.tally.status(r.status_code)
        with self.tally.lock:
            self.tally.sent += 1
            self.tally.by_kind["probe"] += 1
        if r.status_code != 200:
            out["error"] = f"{r.status_code}: {r.text[:300]}"
            return out
        data = r.json()
        choice = data["choices"][0]
        out["tokens"] = [
            bytes(x["bytes"]).hex() if x.get("bytes") is not None else x["token"] for x in choice["logprobs"]["content"]
        ]
        out["text"] = choice["message"]["content"]
        details = data["usage"].get("prompt_tokens_details") or {}
        out["cached"] = details.get("cached_tokens_per_tier") or data["usage"].get("cached_tokens_per_tier")
        if self.probe_reference is None:
            self.probe_reference = out
            out["match"] = True
        else:
            out["match"] = out["tokens"] == self.probe_reference["tokens"]
        return out

    def drain_server(self, timeout: float = 60.0) -> dict | None:
        """Wait until the server has nothing running or waiting (aborted hang-ups leave soon after)."""
        end = time.monotonic() + timeout
        stats = None
        while time.monotonic() < end:
            stats = self.cache_stats()
            if stats and stats["running"] == 0 and stats["waiting"] == 0 and stats["running_device_kv_bytes"] == 0:
                return stats
            time.sleep(0.5)
        return stats

    def drained_flush(self, label: str) -> dict:
        t = round(time.monotonic() - self.t0, 1)
        rec: dict[str, Any] = {"t": t, "label": label}
        t_pause = time.monotonic()
        rec["clients_drained"] = self.gate.close_and_drain(REQUEST_TIMEOUT_S)
        try:
            idle = self.drain_server()
            rec["server_idle"] = bool(idle and idle["running"] == 0 and idle["waiting"] == 0)
            rec["locked_before"] = idle["locked_nodes"] if idle else None
            try:
                r = self.admin.post("/flush_cache")
                rec["flush_status"] = r.status_code
                self.tally_admin(r)
            except httpx.HTTPError as exc:
                rec["flush_status"] = f"{type(exc).__name__}: {exc}"
            after = self.sample("after-flush")
            self.samples.append(after)
            rec.update(
                {
                    k: after.get(k)
                    for k in ("host_used_pages", "device_used_pages", "locked_nodes", "running", "waiting", "rss_mb")
                }
            )
            for name in ("after-flush", "cached"):  # from L3 (or recomputed), then from L1
                p = self.probe(f"{label}:{name}")
                self.probes.append(p)
            rec["probes_match"] = all(p.get("match") for p in self.probes[-2:])
        finally:
            self.gate.open.set()
        rec["paused_s"] = round(time.monotonic() - t_pause, 1)
        self.flushes.append(rec)
        return rec

    def load_flush(self, tier: str) -> None:
        rec: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1), "tier": tier}
        try:
            r = self.admin.post("/admin/flush_cache", json={"tier": tier})
            rec["status"] = r.status_code
            self.tally_admin(r)
        except httpx.HTTPError as exc:
            rec["status"] = f"{type(exc).__name__}: {exc}"
        self.load_flushes.append(rec)

    def accounting(self) -> dict:
        """``GET /admin/check_accounting``: the engine's cache invariants and page accounting."""
        try:
            r = self.admin.get("/admin/check_accounting")
        except httpx.HTTPError as exc:
            return {"route": "GET /admin/check_accounting", "error": f"{type(exc).__name__}: {exc}"}
        out: dict[str, Any] = {"route": "GET /admin/check_accounting", "status": r.status_code}
        try:
            out["body"] = r.json()
        except ValueError:
            out["body"] = r.text[:500]
        return out

    # ---- the run ----------------------------------------------------------------------
    def progress(self) -> None:
        t = self.tally.snapshot()
        last = self.samples[-1] if self.samples else {}
        f = self.faults.counts if self.faults else {}
        st = last.get("storage") or {}
        log(
            f"t+{time.monotonic() - self.t0:5.0f}s sent {t['sent']} answered {t['answered']} hung up "
            f"{sum(t['hangups'].values())} "
            f"5xx {self.tally.fives()} status {t['by_status']} transport errors {sum(t['transport_errors'].values())} "
            f"| rss {last.get('rss_mb')} MB host {last.get('host_used_pages')}/{last.get('host_total_pages')} pages "
            f"| L3 objects {st.get('objects')} corrupt {st.get('corrupt')} storage errors {last.get('storage_errors')} "
            f"| faults {sum(v for k, v in f.items() if k not in ('no_objects', 'raced'))} flushes "
            f"{len(self.flushes)}+{len(self.load_flushes)} "
            f"| probes {sum(1 for p in self.probes if p.get('match'))}/{len(self.probes)} ok"
        )

    def run(self) -> None:
        a = self.args
        self.probes.append(self.probe("start"))  # the reference answer (cold)
        self.probes.append(self.probe("start:cached"))
        self.samples.append(self.sample("start"))
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.duration
        clients = [Client(i, self) for i in range(a.clients)]
        for c in clients:
            c.start()
        self.faults = StorageFaults(self)
        self.faults.start()
        next_sample = self.t0 + a.sample_every
        next_progress = self.t0 + 30
        next_flush = self.t0 + a.flush_every
        next_load_flush = self.t0 + a.flush_every / 2
        load_tiers = ("device", "host", "all")
        n_load = 0
        try:
            while True:
                now = time.monotonic()
                if now >= self.deadline:
                    break
                if not self.server.alive():
                    self.admin_errors.append(
                        f"the server exited at t+{now - self.t0:.0f}s (code {self.server.proc.returncode})"
                    )
                    break
                if now >= next_flush:
                    rec = self.drained_flush(f"minute {len(self.flushes) + 1}")
                    log(
                        f"drained flush: host {rec.get('host_used_pages')} device {rec.get('device_used_pages')} "
                        "pages, "
                        f"locked {rec.get('locked_nodes')}, probes {'ok' if rec.get('probes_match') else 'MISMATCH'}, "
                        f"paused {rec['paused_s']} s"
                    )
                    next_flush += a.flush_every
                    continue
                if now >= next_load_flush:
                    self.load_flush(load_tiers[n_load % len(load_tiers)])
                    n_load += 1
                    p = self.probe(f"under load {n_load}")
                    p["under_load"] = True
                    self.probes.append(p)
                    next_load_flush += a.flush_every
                    continue
                if now >= next_sample:
                    self.samples.append(self.sample())
                    next_sample += a.sample_every
                    continue
                if now >= next_progress:
                    self.progress()
                    next_progress += 30
                    continue
                time.sleep(min(1.0, max(0.05, min(next_flush, next_load_flush, next_sample, next_progress) - now)))
        finally:
            self.stop.set()
            self.gate.open.set()
            for c in clients:
                c.join(REQUEST_TIMEOUT_S + 30)
            self.faults.join(60)
        self.progress()


# --------------------------------------------------------------------------------------------
# checks and report
# --------------------------------------------------------------------------------------------


def evaluate(
    soak: Soak, final: dict, exit_code: int | None, tracebacks: list[str], args: argparse.Namespace
) -> tuple[dict, list]:
    t = soak.tally.snapshot()
    warm_end = soak.duration * args.warmup_fraction
    post = [s for s in soak.samples if s.get("label") in ("", "end") and s["t"] >= warm_end and s.get("rss_mb")]
    rss = [s["rss_mb"] for s in post]
    host = [s.get("host_used_pages") for s in post if s.get("host_used_pages") is not None]
    drained = [f for f in soak.flushes]
    baseline = drained[0].get("host_used_pages") if drained else None
    mem = {
        "warmup_end_s": round(warm_end, 1),
        "rss_mb_start": soak.samples[0].get("rss_mb") if soak.samples else None,
        "rss_mb_warmup": rss[0] if rss else None,
        "rss_mb_end": rss[-1] if rss else None,
        "rss_mb_min_after_warmup": min(rss) if rss else None,
        "rss_mb_max_after_warmup": max(rss) if rss else None,
        "rss_max_over_min_after_warmup": round(max(rss) / min(rss), 4) if rss else None,
        # the median of the last three samples over that of the first three after the warm-up, minus 1
        "rss_growth_after_warmup": round(statistics.median(rss[-3:]) / statistics.median(rss[:3]) - 1, 4)
        if rss
        else None,
        "rss_samples_after_warmup": len(rss),
        "threads_warmup": post[0].get("threads") if post else None,
        "threads_end": post[-1].get("threads") if post else None,
        "host_pages_total": soak.samples[-1].get("host_total_pages") if soak.samples else None,
        "host_pages_warmup": host[0] if host else None,
        "host_pages_end": host[-1] if host else None,
        "host_pages_max_after_warmup": max(host) if host else None,
        "host_pages_after_flushes": [f.get("host_used_pages") for f in drained],
        "host_pages_post_flush_baseline": baseline,
        "device_pages_after_flushes": [f.get("device_used_pages") for f in drained],
    }
    reference = soak.probe_reference
    probes = soak.probes
    checked = [p for p in probes if not p.get("under_load")]
    under = [p for p in probes if p.get("under_load")]
    fives = soak.tally.fives()
    four = {code: n for code, n in t["by_status"].items() if code.startswith("4")}
    checks = []

    def check(name: str, ok: bool, detail: Any) -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    check(
        "no 5xx (HTTP status or in-band stream error)",
        fives == 0,
        {"5xx": fives, "by_status": t["by_status"], "inband": t["inband_errors"]},
    )
    # with the answers' own words (the first few non-200 answers): a 4xx here is a server defect
    four_detail = {"by_status": four, "examples": t["examples"][:10]} if four else four
    check("no 4xx (every request is valid)", not four, four_detail)
    check("no transport error but our hang-ups", not t["transport_errors"], t["transport_errors"])
    check("no in-band stream error", not t["inband_errors"], t["inband_errors"])
    check("every answer well formed", t["bad_answers"] == 0, t["bad_answers"])
    check("admin calls all 200", not soak.admin_errors, soak.admin_errors[:10])
    check("flushes under load all 200", all(f.get("status") == 200 for f in soak.load_flushes), soak.load_flushes)
    check(
        "greedy probe equals its first answer at every drained check",
        reference is not None and all(p.get("match") for p in checked),
        {
            "checks": len(checked),
            "mismatches": [p["label"] for p in checked if not p.get("match")],
            "errors": [p.get("error") for p in checked if p.get("error")],
        },
    )
    check(
        "greedy probe under load equals its first answer",
        all(p.get("match") for p in under),
        {"checks": len(under), "mismatches": [p["label"] for p in under if not p.get("match")]},
    )
    if rss and len(rss) >= 2:
        check(
            f"RSS growth after warm-up <= {args.rss_tolerance:.0%} (median of the last 3 samples / first 3)",
            mem["rss_growth_after_warmup"] <= args.rss_tolerance,
            {
                k: mem[k]
                for k in (
                    "rss_mb_warmup",
                    "rss_mb_end",
                    "rss_growth_after_warmup",
                    "rss_mb_min_after_warmup",
                    "rss_mb_max_after_warmup",
                    "rss_max_over_min_after_warmup",
                )
            },
        )
    else:
        check("RSS sampled after warm-up", False, f"{len(rss)} samples")
    check(
        "every drained flush reached",
        len(drained) >= max(1, int(soak.duration // args.flush_every) - 1)
        and all(f.get("flush_status") == 200 and f.get("clients_drained") and f.get("server_idle") for f in drained),
        [{k: f.get(k) for k in ("t", "flush_status", "clients_drained", "server_idle", "paused_s")} for f in drained],
    )
    check(
        "host pool back to its post-flush baseline after every flush",
        baseline is not None and all(f.get("host_used_pages") == baseline for f in drained),
        {"baseline": baseline, "after_flushes": mem["host_pages_after_flushes"]},
    )
    check(
        "nothing locked, running or waiting after each drained flush",
        all(f.get("locked_nodes") == 0 and f.get("running") == 0 and f.get("waiting") == 0 for f in drained + [final]),
        [{k: f.get(k) for k in ("t", "locked_nodes", "running", "waiting")} for f in drained + [final]],
    )
    acc = final.get("accounting") or {}
    body = acc.get("body") if isinstance(acc.get("body"), dict) else {}
    check(
        "accounting clean (engine.check_accounting over HTTP), nothing live or locked when drained",
        acc.get("status") == 200 and body.get("live_requests") == 0 and body.get("locked_nodes") == 0,
        acc,
    )
    check("server alive until the end", final.get("alive_at_end", False), final.get("health"))
    check("server exits 0 on SIGTERM", exit_code == 0, exit_code)
    report = {
        "config": {
            "minutes": args.minutes,
            "clients": args.clients,
            "seed": args.seed,
            "flush_every_s": args.flush_every,
            "sample_every_s": args.sample_every,
            "serve_flags": ["--device-tokens", str(args.device_tokens), *SERVE_FLAGS, *args.serve_flags.split()],
            "mix": MIX,
            "docs_bytes": [len(d.encode()) for d in soak.docs],
        },
        "server": {
            "url": soak.server.url,
            "ready_s": final.get("ready_s"),
            "exit_code": exit_code,
            "log": str(soak.server.log_path),
            "tracebacks": len(tracebacks),
            "traceback_lines": tracebacks[:20],
            "error_lines": soak.server.error_lines(),
        },
        "requests": t,
        "fives": fives,
        "memory": mem,
        "probe": {
            "reference_text": reference.get("text") if reference else None,
            "checks": len(checked),
            "under_load": len(under),
            "all": probes,
        },
        "flushes": {"drained": drained, "under_load": soak.load_flushes},
        "faults": {
            "counts": dict(soak.faults.counts) if soak.faults else {},
            "outages": soak.faults.outages if soak.faults else [],
            "errors": soak.faults.errors if soak.faults else [],
        },
        "final": final,
        "samples": soak.samples,
        "admin_errors": soak.admin_errors,
        "checks": checks,
        "passed": all(c["ok"] for c in checks),
    }
    return report, checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--minutes", type=float, default=30.0, help="length of the soak (traffic), after start-up (default 30)"
    )
    p.add_argument("--json", default=None, help="write every figure and check here")
    p.add_argument("--port", type=int, default=0, help="HTTP port of the server (default: a free one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic and of the faults")
    p.add_argument("--keep-dir", action="store_true", help="keep the working folder (server log, L3 directory)")
    p.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    p.add_argument("--flush-every", type=float, default=60.0, help="seconds between drained flushes (default 60)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS / pool samples (default 10)")
    p.add_argument(
        "--rss-tolerance", type=float, default=0.05, help="RSS growth after the warm-up at most this (default 0.05)"
    )
    p.add_argument(
        "--warmup-fraction", type=float, default=0.2, help="the share of the run before RSS is judged (default 0.2)"
    )
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds the server may take to be ready")
    p.add_argument(
        "--device-tokens",
        type=int,
        default=8192,
        help="L1 size in tokens (default 8192: 512 pages; L2 is twice that, so documents spill to L3)",
    )
    p.add_argument(
        "--xla-cache",
        default=None,
        help="--compilation-cache-dir of the server (default: TMPDIR/strata_soak_xla_cache)",
    )
    p.add_argument("--serve-flags", default="", help="more `strata-jax serve` flags")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="strata-soak-"))
    server = Server(args, workdir)
    ready_s = server.start()
    soak = Soak(args, server)
    final: dict[str, Any] = {"ready_s": round(ready_s, 1)}
    exit_code: int | None = None
    try:
        log(
            f"soak: {args.minutes:g} min, {args.clients} clients, seed {args.seed}, docs {[len(d) for d in soak.docs]} "
            "bytes"
        )
        soak.run()
        final["alive_at_end"] = server.alive()
        try:
            final["health"] = httpx.get(server.url + "/health", timeout=30).status_code
        except httpx.HTTPError as exc:
            final["health"] = f"{type(exc).__name__}: {exc}"
        final["alive_at_end"] = final["alive_at_end"] and final["health"] == 200
        if final["alive_at_end"]:
            last = soak.drained_flush("end")
            final.update(
                {k: last.get(k) for k in ("locked_nodes", "running", "waiting", "host_used_pages", "device_used_pages")}
            )
            soak.samples.append(dict(soak.sample("end")))
            final["accounting"] = soak.accounting()
            stats = soak.cache_stats() or {}
            final["storage"] = stats.get("storage")
            final["transfers"] = stats.get("transfers")
            final["hit_tokens"] = stats.get("hit_tokens")
            final["evictions"] = stats.get("evictions")
            final["compiles_after_warmup"] = stats.get("compiles_after_warmup")
    finally:
        soak.stop.set()
        exit_code = server.stop(120)
        soak.admin.close()
    tracebacks = server.tracebacks()
    report, checks = evaluate(soak, final, exit_code, tracebacks, args)
    t = report["requests"]
    m = report["memory"]
    print()
    print(
        f"requests: sent {t['sent']}, answered {t['answered']}, by status {t['by_status']}, hung up {t['hangups']}, "
        f"transport errors {t['transport_errors']}, in-band errors {t['inband_errors']}, 5xx {report['fives']}"
    )
    print(f"by kind: {t['by_kind']}; cached tokens per tier: {t['cached_tokens_per_tier']}")
    print(
        f"RSS MB: start {m['rss_mb_start']}, warm-up {m['rss_mb_warmup']}, end {m['rss_mb_end']} (growth "
        f"{m['rss_growth_after_warmup']}), "
        f"after warm-up {m['rss_mb_min_after_warmup']}..{m['rss_mb_max_after_warmup']} (max/min "
        f"{m['rss_max_over_min_after_warmup']}); "
        f"threads {m['threads_warmup']} -> {m['threads_end']}"
    )
    print(
        f"host pool pages (of {m['host_pages_total']}): warm-up {m['host_pages_warmup']}, end {m['host_pages_end']}, "
        f"after each drained flush {m['host_pages_after_flushes']}"
    )
    print(f"faults: {report['faults']['counts']}, outages {report['faults']['outages']}")
    print(
        f"L3 at the end: {final.get('storage')}, storage errors {(final.get('transfers') or {}).get('storage_errors')}"
    )
    print(f"accounting: {final.get('accounting')}")
    print(
        f"server: ready after {final.get('ready_s')} s, exit code {exit_code}, tracebacks in its log {len(tracebacks)}"
    )
    for line in tracebacks[:5]:
        print(f"  {line}")
    for c in checks:
        print(
            f"{'PASS' if c['ok'] else 'FAIL'}  {c['name']}"
            + ("" if c["ok"] else f": {json.dumps(c['detail'], default=str)[:600]}")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"JSON: {args.json}")
    if args.keep_dir:
        print(f"kept: {workdir} (server log {server.log_path}, L3 {server.storage_dir})")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print("PASSED" if report["passed"] else "FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
