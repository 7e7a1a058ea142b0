"""Transfer metrics per peer, the same on every end of a KV move: prefill's NIXL writes into a decode
pool and decode's wait for them, a role's reads and writes of L3 pages and the store's side of them.

One `TransferMetrics` per process, in its own registry (api/metrics.py and the store's /metrics
append it to what they render). `op` says which move, `peer` who is on the other end (an address or
a NIXL agent name, whatever that process knows it by). A move starts (in flight +1) and ends once:
ok (bytes, latency) or failed (the failure counter; its latency is still observed).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384)
SIZE_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 11))  # 4 KiB .. 1 GiB


class TransferMetrics:
    def __init__(self, model_name: str | None = None):
        """model_name: the label every role's samples carry (api/metrics.py sets the served name); None
        (the store, which serves any model): no such label."""
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lbl = ["op", "peer"] if model_name is None else ["model_name", "op", "peer"]
        self.bytes = Counter("trnd:kv_transfer_bytes", "KV bytes moved, by operation and peer.", lbl, registry=r)
        self.latency = Histogram("trnd:kv_transfer_latency_seconds", "Start to end of one KV transfer.", lbl,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.failures = Counter("trnd:kv_transfer_failures", "KV transfers that failed or were given up.", lbl,
                                registry=r)
        # What one posted transfer carried: NIXL's cost is per descriptor, so a handoff's pages coalesced
        # into few large descriptors (transfer/plan.py) is what these show.
        self.descriptors = Histogram("trnd:kv_transfer_descriptors", "Descriptors in one posted KV transfer.", lbl,
                                     buckets=DESCRIPTOR_BUCKETS, registry=r)
        self.size = Histogram("trnd:kv_transfer_size_bytes", "Bytes in one posted KV transfer.", lbl,
                              buckets=SIZE_BUCKETS, registry=r)
        self.in_flight = Gauge("trnd:kv_transfers_in_flight", "KV transfers started and not ended.", lbl,
                               registry=r)
        self._lock = threading.Lock()
        self._open: dict[tuple[str, object], tuple[str, float]] = {}  # (op, key) -> (peer, t0)

    def start(self, op: str, peer: str, key: object = None) -> float:
        """A transfer begins; `key` lets `end` find it (its peer and start time), else keep the t0."""
        t0 = time.monotonic()
        self.in_flight.labels(*self._labels(op, peer)).inc()
        if key is not None:
            with self._lock:
                self._open[(op, key)] = (peer, t0)
        return t0

    def end(self, op: str, peer: str | None = None, nbytes: int = 0, ok: bool | None = True,
            t0: float | None = None, key: object = None) -> None:
        """ok: bytes and latency; False: a failure; None: given up by its owner (an abort): neither."""
        if key is not None:
            with self._lock:
                peer, t0 = self._open.pop((op, key), (None, None))
        if peer is None:
            return  # never started (or ended already): count nothing twice
        self.in_flight.labels(*self._labels(op, peer)).dec()
        if ok is None:
            return
        if t0 is not None:
            self.latency.labels(*self._labels(op, peer)).observe(time.monotonic() - t0)
        if ok:
            self.bytes.labels(*self._labels(op, peer)).inc(nbytes)
        else:
            self.failures.labels(*self._labels(op, peer)).inc()

    def posted(self, op: str, peer: str, descriptors: int, nbytes: int) -> None:
        """One transfer went out: how many descriptors, how many bytes."""
        self.descriptors.labels(*self._labels(op, peer)).observe(descriptors)
        self.size.labels(*self._labels(op, peer)).observe(nbytes)

    def failed(self, op: str, peer: str) -> None:
        """A transfer that could not even start (the post was refused)."""
        self.failures.labels(*self._labels(op, peer)).inc()

    def _labels(self, op: str, peer: str) -> tuple[str, ...]:
        return (op, peer) if self.model_name is None else (self.model_name, op, peer)

    def open_keys(self, op: str) -> list[object]:
        with self._lock:
            return [k for o, k in self._open if o == op]

    def render(self) -> bytes:
        return generate_latest(self.registry)
