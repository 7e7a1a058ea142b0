"""The router's view of its targets' real caches: their KV events (trnd/events, vLLM's format), indexed by
block hash, so a request goes to the target that holds the longest prefix of its blocks, not to the one
the router last sent a similar text (policy.py PrefixIndex, the guess it replaces).

Each target's /admin/state names its events endpoint (targets.py learns it); one thread here subscribes
to every target (SUB, a replay from seq 0 at the start: the publisher's first batch is AllBlocksCleared,
so a full replay is the whole cache) and applies the batches to the index. A request's blocks are hashed
as the targets hash them (trnd/events/hashes.py: the prompt's token ids, the page size, the salt the
target will key them under), so a hit here is a hit there.

Never a silent fallback: a target whose feed is not up, started mid-stream (the replay buffer no longer
held its first batch) or lost batches is `stale`; an index with nothing in it while requests are routed
on it is `empty`. Both are gauges and counters in /metrics and a warning in the log; routing then goes
by load, and says so (rule "load", `trnd:router_kv_index_unusable`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import zmq

from trnd.events import wire
from trnd.events.hashes import VllmHasher
from trnd.events.subscriber import Subscriber

log = logging.getLogger("trnd.router")

WARN_EVERY_S = 30.0
PREFILL = "prefill:"  # a prefill server's feed is named PREFILL + its control address (as decode names it)


@dataclass
class Feed:
    addr: str
    endpoint: str
    replay_endpoint: str | None
    sub: Subscriber | None = None
    state: str = "starting"  # ok | starting | incomplete (joined mid-stream) | lost (batches missed) | down
    batches: int = 0
    last_batch: float = 0.0
    error: str | None = None


@dataclass
class KVIndex:
    """vLLM block hash -> the targets holding it; per target its hashes (for AllBlocksCleared, a target gone)."""
    holders: dict[bytes, set[str]] = field(default_factory=lambda: defaultdict(set))
    blocks: dict[str, set[bytes]] = field(default_factory=lambda: defaultdict(set))

    def apply(self, addr: str, batch: wire.KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, wire.BlockStored):
                for h in e.block_hashes:
                    h = h if isinstance(h, bytes) else int(h).to_bytes(8, "big")
                    self.holders[h].add(addr)
                    self.blocks[addr].add(h)
            elif isinstance(e, wire.BlockRemoved):
                for h in e.block_hashes:
                    h = h if isinstance(h, bytes) else int(h).to_bytes(8, "big")
                    self._drop(addr, h)
            elif isinstance(e, wire.AllBlocksCleared):
                self.forget(addr)

    def _drop(self, addr: str, h: bytes) -> None:
        self.blocks[addr].discard(h)
        s = self.holders.get(h)
        if s is not None:
            s.discard(addr)
            if not s:
                del self.holders[h]

    def forget(self, addr: str) -> None:
        for h in list(self.blocks.pop(addr, ())):
            s = self.holders.get(h)
            if s is not None:
                s.discard(addr)
                if not s:
                    del self.holders[h]

    def longest(self, hashes: list[bytes], addrs: set[str]) -> tuple[str | None, int]:
        """The target among addrs holding the longest leading run of hashes, and its length."""
        live, n = set(addrs), 0
        for h in hashes:
            have = self.holders.get(h, set()) & live
            if not have:
                break
            live, n = have, n + 1
        return (min(live) if n else None), n

    def size(self, addr: str) -> int:
        return len(self.blocks.get(addr, ()))


class EventRouting:
    """The feeds (one thread) and the index they fill; `blocks_of` for the request side."""

    def __init__(self, page_size_hint: int | None = None):
        self.index = KVIndex()
        self.lock = threading.Lock()
        self.feeds: dict[str, Feed] = {}
        self.ctx = zmq.Context()
        self.hashers: dict[tuple[str, str | None], VllmHasher] = {}
        self.block_size = page_size_hint
        self.unusable = 0  # requests routed by load because no candidate's feed was ok
        self.empty_routes = 0  # requests routed on an index that held nothing
        self.hits = self.misses = self.prefill_hits = 0
        self._last_warn = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trnd-router-kv-events", daemon=True)
        self.thread.start()

    # -- targets (the router's loop) -------------------------------------------------------------------

    def sync(self, addr: str, kv: dict | None) -> None:
        """The target's kv_events part of /admin/state (None: it publishes none)."""
        with self.lock:
            feed = self.feeds.get(addr)
            if kv is None:
                if feed is None:
                    self.feeds[addr] = Feed(addr, "", None, state="down", error="the target publishes no KV events "
                                            "(--kv-events-config)")
                return
            if feed is not None and feed.endpoint == kv["endpoint"]:
                return
            if feed is not None and feed.sub is not None:
                feed.sub.close()
            self.index.forget(addr)
            self.block_size = kv.get("block_size") or self.block_size
            self.feeds[addr] = Feed(addr, kv["endpoint"], kv.get("replay_endpoint"))
            self.hashers.setdefault((kv.get("hash_algo") or "sha256", None), VllmHasher(kv.get("hash_algo") or "sha256"))

    def blocks_of(self, token_ids: list[int], salt: str | None) -> list[bytes]:
        """The vLLM block hashes the targets give this prompt's full pages (all but its last token: a target
        computes at least that one)."""
        if not self.block_size:
            return []
        hasher = next(iter(self.hashers.values()), None) or self.hashers.setdefault(("sha256", None), VllmHasher())
        return hasher.chain(None, token_ids[:-1], self.block_size, salt)

    def prefill_for(self, hashes: list[bytes]) -> tuple[str | None, int]:
        """The prefill server (its control address) holding the longest prefix of these blocks: the prefill
        leg routed by prefix too (decode takes it as a hint: roles/decode.py _pick)."""
        if not hashes:
            return None, 0
        with self.lock:
            ok = {a for a, f in self.feeds.items() if a.startswith(PREFILL) and f.state == "ok"}
            addr, n = self.index.longest(hashes, ok) if ok else (None, 0)
        if n:
            self.prefill_hits += 1
        return (addr[len(PREFILL):] if addr else None), n

    def view(self) -> "IndexView":
        return IndexView(self)

    def usable(self, addrs: set[str]) -> set[str]:
        with self.lock:
            return {a for a in addrs if (f := self.feeds.get(a)) is not None and f.state == "ok"}

    def longest(self, hashes: list[bytes], addrs: set[str]) -> tuple[str | None, int]:
        with self.lock:
            return self.index.longest(hashes, addrs)

    def note_route(self, ok_addrs: set[str], candidates: set[str], n: int) -> None:
        """Count one request routed on events; alarm on a stale or empty index."""
        stale = sorted(candidates - ok_addrs)
        if not ok_addrs:
            self.unusable += 1
            self._warn(f"kv index unusable (feeds of {', '.join(stale)}: "
                       f"{'; '.join(self.feed_state(a) for a in stale)}): routing by load")
            return
        if stale:
            self._warn(f"kv index stale for {', '.join(stale)} ({'; '.join(self.feed_state(a) for a in stale)}): "
                       f"they are routed by load only")
        with self.lock:
            empty = all(self.index.size(a) == 0 for a in ok_addrs)
        if empty:
            self.empty_routes += 1
            if self.empty_routes > 10:
                self._warn(f"kv index empty after {self.empty_routes} routed requests: are the targets publishing "
                           f"what they cache?")
        if n:
            self.hits += 1
        else:
            self.misses += 1

    def feed_state(self, addr: str) -> str:
        f = self.feeds.get(addr)
        return "no feed" if f is None else f.state + (f": {f.error}" if f.error else "")

    def forget(self, addr: str) -> None:
        with self.lock:
            self.index.forget(addr)
            f = self.feeds.pop(addr, None)
            if f is not None and f.sub is not None:
                f.sub.close()

    def stats(self) -> dict:
        with self.lock:
            return {a: {"state": f.state, "blocks": self.index.size(a), "batches": f.batches,
                        "endpoint": f.endpoint, "error": f.error} for a, f in self.feeds.items()}

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        with self.lock:
            for f in self.feeds.values():
                if f.sub is not None:
                    f.sub.close()
        self.ctx.term()

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warn >= WARN_EVERY_S:
            self._last_warn = now
            log.warning("%s", msg)

    # -- the feeds' thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                feeds = list(self.feeds.values())
            busy = False
            for f in feeds:
                if f.state == "down" and not f.endpoint:
                    continue
                if f.sub is None:
                    self._start(f)
                try:
                    got = f.sub.poll(0) if f.sub is not None else []
                except (zmq.ZMQError, ValueError, TypeError) as e:
                    f.state, f.error = "down", f"{type(e).__name__}: {e}"
                    continue
                if got:
                    busy = True
                    self._apply(f, got)
            if not busy:
                time.sleep(0.005)

    def _start(self, f: Feed) -> None:
        """Subscribe, then rebuild from the replay buffer: seq 0 is the publisher's AllBlocksCleared."""
        try:
            f.sub = Subscriber(f.endpoint, f.replay_endpoint, ctx=self.ctx)
            time.sleep(0.05)  # the SUB connection, so nothing published from here on is missed
            past = f.sub.replay(0)
        except zmq.ZMQError as e:
            f.state, f.error = "down", str(e)
            return
        if f.replay_endpoint is None:
            f.state, f.error = "incomplete", "no replay endpoint: what was cached before the router came is unknown"
        elif not past and f.sub.next_seq is None:
            f.state, f.error = "incomplete", "the replay endpoint did not answer"
        elif past and past[0][0] != 0:
            f.state, f.error = "incomplete", f"joined at seq {past[0][0]}: the replay buffer no longer holds the start"
        else:
            f.state, f.error = "ok", None
        if past:
            f.sub.next_seq = past[-1][0] + 1
            self._apply(f, past)

    def _apply(self, f: Feed, got) -> None:
        with self.lock:
            for _, batch in got:
                self.index.apply(f.addr, batch)
            f.batches += len(got)
            f.last_batch = time.monotonic()
            if f.sub is not None and f.sub.lost and f.state == "ok":
                f.state, f.error = "lost", f"{f.sub.lost} batches missed and not replayable"


class IndexView:
    """What policy.choose asks of an index (longest, record, forget), answered from the events: only targets
    whose feed is ok compete on their caches, each routing is counted (note_route), nothing is recorded (the
    targets' own events say what they cache) and a target taken out keeps its feed (a restart clears it)."""

    def __init__(self, routing: EventRouting):
        self.routing = routing

    def longest(self, hashes: list[bytes], addrs: set[str]) -> tuple[str | None, int]:
        ok = self.routing.usable(addrs)
        addr, n = self.routing.longest(hashes, ok) if ok and hashes else (None, 0)
        self.routing.note_route(ok, set(addrs), n)
        return addr, n

    def record(self, hashes, addr: str) -> None:
        pass

    def forget(self, addr: str) -> None:
        pass
