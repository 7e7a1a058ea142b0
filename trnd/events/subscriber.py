"""The consuming side of KV events (a router's index, the tests): SUB to a publisher, batches in seq order,
a gap filled from the replay endpoint (DEALER: a request of one 8-byte seq, replies until END_SEQ).

Plain and blocking (`poll`), so a caller owns the thread or loop it runs on; the router polls it from its
own thread (router/events.py).
"""

from __future__ import annotations

import logging

import zmq

from trnd.events import wire

log = logging.getLogger("trnd.events")


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.next_seq: int | None = None  # the seq expected next; None: nothing seen yet
        self.live_last: int | None = None  # the last seq seen on the live socket
        self.gaps = self.replayed = self.lost = self.restarts = 0

    def close(self) -> None:
        self.sub.close(0)

    def poll(self, timeout_ms: int = 100) -> list[tuple[int, wire.KVEventBatch]]:
        """Batches that arrived within timeout_ms, in seq order, with any gap before them replayed."""
        out = []
        if not self.sub.poll(timeout_ms):
            return out
        while True:
            try:
                _, seq_b, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            seq = int.from_bytes(seq_b, "big")
            if self.live_last is not None and seq <= self.live_last:
                # seq went back on the live socket: the publisher started again (a fixed endpoint). What it
                # sent before this one comes from its replay buffer, from its first batch (AllBlocksCleared)
                self.restarts += 1
                self.next_seq = 0
            self.live_last = seq
            if self.next_seq is not None and seq < self.next_seq:
                continue  # already had it (replayed)
            if self.next_seq is not None and seq > self.next_seq:
                self.gaps += 1
                out += self.replay(self.next_seq, seq)
            out.append((seq, wire.decoder.decode(payload)))
            self.next_seq = seq + 1

    def replay(self, first: int, until: int | None = None, timeout_ms: int = 2000) -> list[tuple[int, wire.KVEventBatch]]:
        """Batches [first, until) from the replay endpoint (as many as its buffer still holds)."""
        got: list[tuple[int, wire.KVEventBatch]] = []
        if self.replay_endpoint is None:
            self.lost += (until - first) if until is not None else 0
            return got
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while dealer.poll(timeout_ms):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == wire.END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if seq >= first and (until is None or seq < until):
                    got.append((seq, wire.decoder.decode(frames[3])))
        finally:
            dealer.close(0)
        self.replayed += len(got)
        if until is not None:
            self.lost += (until - first) - len(got)
        return got
