"""scripts/peer_bench.py without a model: the table's medians and ratios, document lengthening,
the --doc-tokens parsing, and the multi-turn phase against a stub OpenAI server that echoes
what it was sent (the real servers run in `scripts/peer_vllm_cpu.sh`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peer_bench.py"
spec = importlib.util.spec_from_file_location("peer_bench", SCRIPT)
assert spec is not None and spec.loader is not None
peer = importlib.util.module_from_spec(spec)
sys.modules["peer_bench"] = peer  # its dataclasses resolve their annotations through it
spec.loader.exec_module(peer)


def words(text: str) -> int:
    return len(text.split())


def test_median_skips_runs_without_a_number():
    assert peer.median([3.0, None, 1.0, 2.0]) == 2.0
    assert peer.median([None, None]) is None


def test_cells_list_every_run_then_the_median():
    assert peer._fmt([1.0, 3.0, 2.0], 1, "s", 2) == "1.00 / 3.00 / 2.00 s (median 2.00)"
    assert peer._fmt([0.5], 1e3, "ms", 0) == "500 ms"


@pytest.mark.parametrize(
    "a, b, higher_is_better, expected",
    [
        ([1.0, 2.0, 3.0], [4.0, 4.0, 4.0], False, "0.50x (ahead)"),  # a time: lower is better
        ([1.0, 2.0, 3.0], [4.0, 4.0, 4.0], True, "0.50x (behind)"),  # a rate: higher is better
        ([4.0], [4.0], True, "1.00x (tie)"),
        ([4.01], [4.0], False, "1.00x (tie)"),  # 1.0025x: the cell cannot show a winner
        ([4.1], [4.0], False, "1.02x (behind)"),
        ([None], [4.0], True, "n/a"),
    ],
)
def test_ratio_of_medians_says_who_is_ahead(a, b, higher_is_better, expected):
    assert peer.ratio_cell(a, b, higher_is_better) == expected


def test_table_has_a_ratio_column_and_the_turns_row():
    args = argparse.Namespace(
        strata_flags="",
        vllm_omp_bind="0-1",
        vllm_flags="",
        cached_questions=5,
        decode_tokens=128,
        turns=4,
        concurrent_docs=3,
        concurrent_questions=8,
        concurrent_tokens=64,
    )

    def run(kind: str, cold: float) -> object:
        r = peer.Run(kind, 1, doc_tokens=2000)
        r.cold = peer.Result("doc0/q0", ttft_s=cold)
        r.turns = [peer.Result("turn/a/t0", ttft_s=9.0), peer.Result("turn/a/t1", ttft_s=0.2)]
        return r

    text = peer.table({"strata": [run("strata", 1.0)], "vllm": [run("vllm", 2.0)]}, args, 2000)
    lines = text.splitlines()
    assert "strata-jax / vLLM-CPU (medians)" in lines[0]
    cold = next(line for line in lines if line.startswith("| cold TTFT"))
    assert cold.endswith("| 1.00 s | 2.00 s | 0.50x (ahead) |")
    turns = next(line for line in lines if line.startswith("| later turns"))
    assert "| 200 ms | 200 ms | 1.00x (tie) |" in turns  # the first turn (9 s, cold) is not a later turn
    assert any(line.startswith("| burst of 24") for line in lines)


def test_parse_lengths():
    assert peer.parse_lengths("2000,3500, 7000") == [2000, 3500, 7000]
    for bad in ("", "2000,x", "0", "-5"):
        with pytest.raises(SystemExit, match="--doc-tokens"):
            peer.parse_lengths(bad)


def test_a_short_document_is_lengthened_with_its_own_sentences():
    doc = peer.Doc("d", "One two three. Four five six. Seven eight nine.", ["q"])
    long = peer.lengthen(doc, 30, words)
    assert words(long.text) >= 30
    assert long.text.startswith(doc.text)
    assert set(long.text.replace(".", "").split()) == set(doc.text.replace(".", "").split())
    assert peer.lengthen(doc, 5, words) is doc  # long enough already
    assert peer.lengthen(doc, 500, lambda _: None) is doc  # no tokenizer: left as it is


class EchoChat(BaseHTTPRequestHandler):
    """A streamed chat completion whose answer names how many messages it was sent."""

    seen: list[list[dict]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            self.seen.append(body["messages"])
        answer = f"answer to {len(body['messages'])} messages"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for data in (
            {"choices": [{"delta": {"content": answer}}]},
            {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 10}},
        ):
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *_: object) -> None:
        pass


def test_conversations_carry_their_own_answers_forward():
    EchoChat.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        docs = [peer.Doc(f"doc{i}", f"text {i}.", [f"q{i}a", f"q{i}b"]) for i in range(3)]
        url = f"http://127.0.0.1:{server.server_address[1]}"
        results = peer.run_conversations(url, docs, 3, 8, 10.0)
    finally:
        server.shutdown()
    assert sorted(r.key for r in results) == sorted(f"turn/doc{i}/t{t}" for i in range(3) for t in range(3))
    assert all(r.error is None and r.ttft_s is not None for r in results)
    last = [m for m in EchoChat.seen if len(m) == 5]  # the third turns: user, assistant, user, assistant, user
    assert len(last) == 3
    for messages in last:
        doc = messages[0]["content"].split("\n\n")[0]
        i = int(doc.split()[1].rstrip("."))
        assert messages[0]["content"] == f"text {i}.\n\nQuestion: q{i}a"
        assert messages[1] == {"role": "assistant", "content": "answer to 1 messages"}
        assert messages[2] == {"role": "user", "content": f"Question: q{i}b"}
        assert messages[3] == {"role": "assistant", "content": "answer to 3 messages"}
        assert messages[4] == {"role": "user", "content": f"Question: q{i}a"}
    run = peer.Run("strata", 1, turns=results)
    assert run.later_turn_ttft() is not None


def test_the_burst_sends_every_request_and_times_the_whole():
    EchoChat.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoChat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        items = [(f"conc/d/q{j}", [{"role": "user", "content": f"q{j}"}]) for j in range(5)]
        url = f"http://127.0.0.1:{server.server_address[1]}"
        results, wall = peer.run_concurrent(url, items, 4, 10.0)
    finally:
        server.shutdown()
    assert [r.key for r in results] == [key for key, _ in items]  # in the order sent, none lost
    assert all(r.error is None and r.text == "answer to 1 messages" for r in results)
    assert sorted(m[0]["content"] for m in EchoChat.seen) == [f"q{j}" for j in range(5)]
    assert wall >= max(r.first_s + r.total_s for r in results) > 0
