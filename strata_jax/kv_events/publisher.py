"""``ZmqKVEventPublisher``: KV event batches out on ZMQ, off the engine thread.

The engine thread calls ``publish`` (a non-blocking put into a bounded queue: when the
queue is full the batch is dropped and counted, never waited for); a daemon thread
encodes each batch (``schema``), sends it on a PUB socket as ``(topic, seq, payload)`` and
keeps the last ``buffer_batches`` for the replay socket: a ROUTER where a client (DEALER
or REQ) sends the first sequence number it wants (8 bytes, big-endian) and receives
``(topic, seq, payload)`` for every buffered batch from there, then an end marker
``(b"", -1 as 8 signed bytes, b"")``.  As in vLLM: an endpoint with ``*``, ``ipc://`` or
``inproc://`` is bound, any other is connected to (a proxy that binds); the replay
endpoint is always bound; a data-parallel rank > 0 adds itself to both ports.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque

from strata_jax.kv_events.recorder import RawEvent

log = logging.getLogger("strata_jax.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` for data-parallel rank ``rank``: tcp ports shifted by the rank, inproc suffixed."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"KV events endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")


def binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        max_queue_batches: int = 10_000,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        try:
            import msgspec
            import zmq
        except ImportError as exc:  # pragma: no cover - the serve extra installs both
            raise ImportError(
                f"KV events need pyzmq and msgspec ({exc.name} is missing): pip install 'strata-jax[serve]'"
            ) from exc
        self.block_size = block_size
        self.topic = topic.encode("utf-8")
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank)
        self._queue: queue.Queue[tuple[float, list[RawEvent]] | None] = queue.Queue(maxsize=max_queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = itertools.count()
        self._lock = threading.Lock()  # the counters (engine thread and publisher thread)
        # queued: accepted from the engine; batches / events: sent; dropped: queue full or unencodable
        self.counters = {
            "queued_batches_total": 0,
            "batches_total": 0,
            "events_total": 0,
            "dropped_batches_total": 0,
            "dropped_events_total": 0,
        }
        self._encoder = msgspec.msgpack.Encoder()
        self._zmq = zmq
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            assert self.endpoint is not None
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"KV events: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="strata-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def publish(self, ts: float, events: list[RawEvent]) -> bool:
        """Queue one step's events; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait((ts, events))
            with self._lock:
                self.counters["queued_batches_total"] += 1
            return True
        except queue.Full:
            with self._lock:
                self.counters["dropped_batches_total"] += 1
                self.counters["dropped_events_total"] += len(events)
            return False

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                log.warning("KV events: %d batches still queued at shutdown", self._queue.qsize())
            self._thread.join(timeout=timeout_s)
        self._close_sockets()

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        from strata_jax.kv_events.schema import KVEventBatch, to_struct

        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, raw = item
            try:
                batch = KVEventBatch(ts, [to_struct(e, self.block_size) for e in raw], self.rank)
                payload = self._encoder.encode(batch)
                seq = next(self._seq)
                # Counted under the lock the send happens in: whoever has received this batch and
                # then reads stats() sees it counted (stats() waits for the lock).
                with self._lock:
                    self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                    self._buffer.append((seq, payload))
                    self.counters["batches_total"] += 1
                    self.counters["events_total"] += len(raw)
            except Exception:  # a bad batch must not stop the stream; it is counted as dropped
                log.exception("KV events: a batch could not be published")
                with self._lock:
                    self.counters["dropped_batches_total"] += 1
                    self.counters["dropped_events_total"] += len(raw)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def __repr__(self) -> str:  # pragma: no cover
        return f"ZmqKVEventPublisher({self.endpoint!r}, replay={self.replay_endpoint!r}, rank={self.rank})"
