"""KV events on ZMQ as vLLM publishes them (ZmqEventPublisher): a PUB socket sends (topic, seq, payload) per
batch, seq counting from 0 in 8 big-endian bytes; a ROUTER socket answers a replay request (an 8-byte
starting seq) with every buffered batch from there, then (b"", END_SEQ, b""). A consumer that sees a gap
in seq asks for the rest; one that joins late asks from 0 (as far as the buffer reaches).

One thread owns both sockets (ZMQ sockets are not thread-safe); the engine thread only puts batches on a
bounded queue and never blocks: a full queue drops the batch and counts it (a consumer then sees a gap,
and the replay buffer cannot fill it: its index is stale, and it says so).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from trnd.events import wire

log = logging.getLogger("trnd.events")


def bindable(endpoint: str) -> str:
    """tcp://host:0 binds an ephemeral port (ZMQ spells it *)."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


class Publisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000):
        self.topic = topic.encode()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = None
        try:
            self.pub.bind(bindable(endpoint))
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(bindable(replay_endpoint))
                self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"kv events: cannot bind {endpoint!r}" + (f" / {replay_endpoint!r}" if replay_endpoint
                                                                    else "") + f": {e}") from None
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0  # the next batch's
        self.dropped = 0
        self.replays = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trnd-kv-events", daemon=True)
        self.thread.start()
        log.info("kv events: publishing on %s%s (topic %r)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", topic)

    def publish(self, batch: wire.KVEventBatch) -> None:
        """Any thread; never blocks."""
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("kv events: queue full, %d batches dropped (consumers will see a gap)", self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self._close_sockets()

    def state(self) -> dict:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": self.topic.decode(),
                "seq": self.seq, "dropped": self.dropped, "replays": self.replays}

    def _close_sockets(self) -> None:
        for s in (self.pub, self.replay):
            if s is not None:
                s.close(0)
        self.ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set() or not self.queue.empty():
            if self.replay is not None:
                while self.replay.poll(0):
                    self._serve_replay()
            try:
                batch = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            payload = wire.encoder.encode(batch)
            seq = self.seq.to_bytes(8, "big")
            try:
                self.pub.send_multipart((self.topic, seq, payload))
            except zmq.ZMQError as e:
                log.warning("kv events: send failed (%s)", e)
            self.buffer.append((self.seq, payload))
            self.seq += 1

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.replays += 1
        for seq, payload in list(self.buffer):
            if seq >= first:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", wire.END_SEQ, b""))
