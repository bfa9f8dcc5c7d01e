"""KV events against independent references: a plain msgpack decoder of vLLM's schema (no
structs of ours), and the tree's own view of each tier, walked node by node."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from strata_jax.api import InvalidRequestError, SamplingParams
from strata_jax.cache.hashing import chain_hashes
from strata_jax.engine import Engine, EngineConfig

GREEDY = SamplingParams(max_tokens=4)
PAGE = 16


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(tmp_path, **overrides) -> Engine:
    settings = dict(
        model="tiny",
        warmup=False,
        show_progress=False,
        tiers="L1+L2+L3",
        storage_dir=str(tmp_path / "l3"),
        page_size=PAGE,
        device_tokens=1024,
        hicache_ratio=1.5,
        max_batch_tokens=128,
        max_batch_size=4,
        max_context_tokens=512,
        prefetch_policy="wait_complete",
        prefetch_min_tokens=0,
        kv_events_endpoint=f"ipc://{tmp_path}/events",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{_free_port()}",
        kv_events_topic="kv",
        data_parallel_rank=0,
    )
    settings.update(overrides)
    return Engine(EngineConfig(**settings), start=False)


class Subscriber:
    """Collects (seq, decoded batch) from the PUB socket, decoded without any schema."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list]] = []
        self.payloads: dict[int, bytes] = {}

    def drain_until(self, total: int, timeout_s: float = 20.0) -> None:
        """Receive until the batch with sequence number ``total - 1`` (the ``total``-th published) is in."""
        deadline = time.monotonic() + timeout_s
        while (self.batches[-1][0] + 1 if self.batches else 0) < total:
            assert time.monotonic() < deadline, f"received up to {len(self.batches)} of {total} batches"
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b"kv"
                n = int.from_bytes(seq, "big")
                self.batches.append((n, msgspec.msgpack.decode(payload)))
                self.payloads[n] = payload

    def close(self) -> None:
        self.sock.close(linger=0)


def _connected(engine: Engine, sub: Subscriber) -> None:
    """PUB drops what is sent before a subscriber joins: wait until a probe batch arrives."""
    pub = engine.kv_event_publisher
    deadline = time.monotonic() + 10
    while not sub.sock.poll(50):
        assert time.monotonic() < deadline, "the subscriber never connected"
        pub.publish(0.0, [("cleared",)])  # harmless: nothing is held yet
    sub.drain_until(pub.stats()["queued_batches_total"])
    sub.batches.clear()
    sub.payloads.clear()


def _tree_view(engine: Engine) -> dict[str, set[int]]:
    """What the tree says each tier holds, as 64-bit block hashes recomputed from the tokens."""
    view: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    tree = engine.ctl.tree

    def walk(node, prev: bytes) -> None:
        for child in node.children.values():
            keys = chain_hashes(prev, list(child.key), PAGE)  # independent of the tree's cached hashes
            ints = {int.from_bytes(k[:8], "big") for k in keys}
            if child.device is not None:
                view["GPU"] |= ints
            if child.host is not None:
                view["CPU"] |= ints
            if child.storage_backed:
                view["STORAGE"] |= ints
            walk(child, keys[-1])

    for namespace in tree.namespaces():
        walk(tree.root(namespace), tree.seed(namespace))
    return view


def _replay(batches: list[tuple[int, list]], rank: int = 0) -> dict[str, set[int]]:
    """Apply decoded batches in order, strictly: a store of a held block or a removal of an absent one fails."""
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    expected_seq = batches[0][0] if batches else 0
    for seq, batch in batches:
        assert seq == expected_seq
        expected_seq += 1
        ts, events, dp_rank = batch
        assert isinstance(ts, float) and dp_rank == rank
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                assert ev["block_size"] == PAGE and ev["lora_id"] is None and ev["lora_name"] is None
                assert len(ev["token_ids"]) == PAGE * len(ev["block_hashes"])
                for h in ev["block_hashes"]:
                    assert 0 <= h < 2**64 and h not in held[ev["medium"]], (ev["medium"], h)
                    held[ev["medium"]].add(h)
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    assert h in held[ev["medium"]], (ev["medium"], h)
                    held[ev["medium"]].discard(h)
            else:
                assert kind == "AllBlocksCleared" and set(ev) == {"type"}
                for blocks in held.values():
                    blocks.clear()
    return held


def test_events_replayed_give_what_the_tree_holds_in_every_tier(tmp_path):
    engine = _engine(tmp_path)
    sub = Subscriber(engine.kv_event_publisher.endpoint)
    try:
        _connected(engine, sub)
        probe_events = engine.kv_event_publisher.stats()["queued_batches_total"]  # one event each
        rng = np.random.default_rng(0)
        documents = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(40, 300, size=6)]
        for round_ in range(40):
            op = rng.random()
            if op < 0.75:  # requests sharing documents: inserts, splits, evictions to L2 and L3, loads back
                picks = rng.choice(len(documents), size=int(rng.integers(1, 4)))
                prompts = [documents[i] + rng.integers(3, 250, size=int(rng.integers(1, 40))).tolist() for i in picks]
                engine.generate(prompts, GREEDY)
            elif op < 0.85:
                engine.flush_cache(str(rng.choice(["device", "host"])))
            elif op < 0.9:
                engine.flush_cache("all")
            else:
                engine.flush_cache("storage")
            engine.run_until_idle()
            published = engine.kv_event_publisher.stats()
            assert published["dropped_batches_total"] == 0
            sub.drain_until(published["queued_batches_total"])
            assert _replay(sub.batches) == _tree_view(engine), f"round {round_}"
        kinds = {ev["type"] for _, b in sub.batches for ev in b[1]}
        mediums = {ev["medium"] for _, b in sub.batches for ev in b[1] if "medium" in ev}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"} and mediums == {"GPU", "CPU", "STORAGE"}
        stats = engine.cache_stats()["kv_events"]
        assert stats["events_total"] - probe_events == sum(len(b[1]) for _, b in sub.batches)
    finally:
        engine.shutdown()
        sub.close()


def test_stored_blocks_carry_the_chain_hash_parent_and_tokens(tmp_path):
    engine = _engine(tmp_path, tiers="L1", kv_events_replay_endpoint=None)
    sub = Subscriber(engine.kv_event_publisher.endpoint)
    try:
        _connected(engine, sub)
        prompt = list(range(5, 5 + 3 * PAGE + 7))
        engine.generate([prompt], SamplingParams(max_tokens=1))
        engine.run_until_idle()
        sub.drain_until(engine.kv_event_publisher.stats()["queued_batches_total"])
        stored = [ev for _, b in sub.batches for ev in b[1] if ev["type"] == "BlockStored"]
        keys = chain_hashes(engine.ctl.tree.seed(""), prompt, PAGE)
        ints = [int.from_bytes(k[:8], "big") for k in keys]
        first = stored[0]
        assert first["medium"] == "GPU" and first["parent_block_hash"] is None
        assert first["block_hashes"] == ints[: len(first["block_hashes"])]
        assert first["token_ids"] == prompt[: PAGE * len(first["block_hashes"])]
        blocks = [h for ev in stored for h in ev["block_hashes"]]
        assert blocks[:3] == ints  # the prompt's three full pages, in order
        for ev in stored[1:]:  # a later node's parent is the block before its first
            i = blocks.index(ev["block_hashes"][0])
            assert ev["parent_block_hash"] == blocks[i - 1]
    finally:
        engine.shutdown()
        sub.close()


def test_the_replay_socket_returns_a_missed_range(tmp_path):
    engine = _engine(tmp_path, tiers="L1")
    sub = Subscriber(engine.kv_event_publisher.endpoint)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        _connected(engine, sub)
        for i in range(4):
            engine.generate([list(range(10 + i, 10 + i + 2 * PAGE))], SamplingParams(max_tokens=1))
        engine.run_until_idle()
        total = engine.kv_event_publisher.stats()["queued_batches_total"]
        sub.drain_until(total)
        last = max(sub.payloads)
        first_missed = last - 2
        dealer.connect(engine.kv_event_publisher.replay_endpoint)
        dealer.send_multipart((b"", first_missed.to_bytes(8, "big")))
        replayed = {}
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == b"" and payload == b""
                break
            assert topic == b"kv"
            replayed[int.from_bytes(seq, "big")] = payload
        assert sorted(replayed) == list(range(first_missed, last + 1))
        assert all(replayed[n] == sub.payloads[n] for n in replayed)  # the very bytes published
    finally:
        dealer.close(linger=0)
        engine.shutdown()
        sub.close()


def test_a_full_queue_drops_and_counts_never_blocks(tmp_path):
    from serving.metrics import is_cumulative
    from strata_jax.kv_events.publisher import ZmqKVEventPublisher

    pub = ZmqKVEventPublisher(f"ipc://{tmp_path}/drops", block_size=PAGE, max_queue_batches=1)
    try:
        events = [("stored", "GPU", [1, 2], None, list(range(2 * PAGE)), None, None)]
        t0 = time.perf_counter()
        accepted = sum(pub.publish(0.0, events) for _ in range(20_000))
        elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while pub.stats()["batches_total"] < accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = pub.stats()
        assert stats["queued_batches_total"] == accepted
        assert stats["dropped_batches_total"] == 20_000 - accepted > 0
        assert stats["dropped_events_total"] == stats["dropped_batches_total"]
        assert stats["batches_total"] == accepted
        assert elapsed < 5  # 20,000 puts that never waited for the publisher's thread
    finally:
        pub.close()
    assert is_cumulative("kv_events_dropped_events_total") and is_cumulative("kv_events_batches_total")


def test_off_by_default_and_bad_settings_are_clear_errors(tmp_path):
    engine = Engine(
        EngineConfig(model="tiny", warmup=False, show_progress=False, tiers="L1", device_tokens=1024), start=False
    )
    try:
        assert engine.kv_event_publisher is None and engine.ctl.tree.tier_observer is None
        assert "kv_events" not in engine.cache_stats()
    finally:
        engine.shutdown()
    with pytest.raises(InvalidRequestError, match="kv_events_endpoint must be a ZMQ endpoint"):
        EngineConfig(kv_events_endpoint="localhost:5557")
    with pytest.raises(InvalidRequestError, match="needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(InvalidRequestError, match="data_parallel_rank"):
        EngineConfig(data_parallel_rank=-1)


def test_data_parallel_rank_shifts_ports_and_is_written_in_batches(tmp_path):
    from strata_jax.kv_events.publisher import offset_endpoint

    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    engine = _engine(tmp_path, tiers="L1", data_parallel_rank=3, kv_events_replay_endpoint=None)
    sub = Subscriber(engine.kv_event_publisher.endpoint)
    try:
        assert engine.kv_event_publisher.endpoint == f"ipc://{tmp_path}/events_dp3"
        _connected(engine, sub)
        engine.generate([list(range(3, 3 + 2 * PAGE))], SamplingParams(max_tokens=1))
        engine.run_until_idle()
        sub.drain_until(engine.kv_event_publisher.stats()["queued_batches_total"])
        assert _replay(sub.batches, rank=3)["GPU"]
    finally:
        engine.shutdown()
        sub.close()


def test_metrics_export_the_publisher_counters(tmp_path):
    from serving.metrics import EngineStatsCollector

    engine = _engine(tmp_path, tiers="L1", kv_events_replay_endpoint=None)
    try:
        engine.generate([list(range(3, 3 + 2 * PAGE))], SamplingParams(max_tokens=1))
        engine.run_until_idle()
        deadline = time.monotonic() + 10
        while (
            engine.kv_event_publisher.stats()["batches_total"]
            < engine.kv_event_publisher.stats()["queued_batches_total"]
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        samples = {s.name: s.value for m in EngineStatsCollector(lambda: engine).collect() for s in m.samples}
        stats = engine.kv_event_publisher.stats()
        assert samples["strata_engine_kv_events_dropped_events_total"] == 0
        assert samples["strata_engine_kv_events_batches_total"] == stats["batches_total"] > 0
        assert samples["strata_engine_kv_events_events_total"] == stats["events_total"] > 0
    finally:
        engine.shutdown()
