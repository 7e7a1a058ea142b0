"""`trnd store`: the L3 remote KV store. One large DRAM region, registered with NIXL and carved into
slots of one canonical page each (tp=1 layout: every KV head), shared by every role of every node
that lists this store.

The store only keeps books; page bytes move between a client's pool and a slot by the client's own
NIXL READ or WRITE, without this process's CPU (store/client.py). The control plane
(store/protocol.py) decides which slot and guards it:
    Lookup  -> how many LEADING pages are committed, their slots and checksums, and optionally a lease
               that keeps them from eviction until released or lease_s passes;
    Reserve -> slots for the pages that are not here (evicting LRU unleased pages when full); the
               client writes them, then
    Commit  -> the store hashes each slot and commits the pages whose bytes match the client's
               checksum; a torn or corrupt write is dropped, never served. Reservations never
               committed expire after reserve_s.
The slot size is fixed by the first client's handshake (its canonical page bytes) until restart;
clients whose pages have another size are refused, naming page_bytes. Several namespaces (models,
dtypes) with that page size share the slots, their keys apart. A restart loses only cached pages.

Test hook: with TRND_STORE_DEBUG=1 the admin port also has POST /admin/debug/corrupt (flip a byte of
a committed page's slot) and POST /admin/debug/delay (answer control messages late).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field


from trnd import snapshot as S
from trnd.config import StoreConfig
from trnd.store import protocol as store_wire
from trnd.transfer.metrics import TransferMetrics
from trnd.store.index import COMMITTED, StoreIndex

log = logging.getLogger("trnd.store")

DEBUG_ENV = "TRND_STORE_DEBUG"
EXPIRE_EVERY_S = 0.1


@dataclass
class Client:
    id: int
    name: str
    addr: str
    chan: store_wire.StoreChannel
    manifest: store_wire.StoreManifest
    ns: str
    connected_at: float = field(default_factory=time.time)
    alive: bool = True
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("lookups", "hits", "misses", "reserved", "committed", "rejected", "bytes_in", "bytes_out", "corrupt"), 0))


class StoreServer:
    def __init__(self, cfg: StoreConfig):
        import torch

        from trnd.transfer.nixl import KVAgent, bind_for

        bind_for(cfg.http.host)
        self.cfg = cfg
        self.admin_port: int | None = None  # set once bound (roles/store.py): told to clients in the welcome
        self.secret = cfg.resolved_secret()
        self.memory_bytes = int(cfg.memory_gb * 2**30)
        # torch.empty: the OS commits the region's pages as slots are first written, not now.
        self.region = torch.empty(self.memory_bytes, dtype=torch.uint8)
        self.mem = self.region.numpy()
        self.store_id = uuid.uuid4().hex[:12]
        self.agent = KVAgent(f"store-{self.store_id}", [self.region], cfg.transfer_backend)
        self.index: StoreIndex | None = None  # made when the first client fixes the slot size
        self.slot_bytes = 0
        self.shape_from: str | None = None  # key space of the client that fixed the slot size
        self.clients: dict[int, Client] = {}
        self._ids = itertools.count(1)
        self.debug = os.environ.get(DEBUG_ENV) == "1"
        self.delay_s = 0.0
        self.started = time.time()
        self.counters = dict.fromkeys(("connections", "refused", "unauthenticated", "bytes_in", "bytes_out",
                                       "corrupt_reports", "corrupt_dropped"), 0)
        self.verify_ms = {"n": 0, "total": 0.0, "max": 0.0}
        # per client: serve_read (a lease granted -> released), accept_write (slots reserved -> committed)
        self.xfer_metrics = TransferMetrics()
        self._expirer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- control plane ------------------------------------------------------------------------------

    async def serve(self, sock) -> asyncio.base_events.Server:
        """sock: the control port, bound at start (trnd.procs.bind_port)."""
        self._expirer = asyncio.create_task(self._expire_forever())
        from trnd.procs import start_checked_server

        return await start_checked_server(self._on_conn, sock)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            if self.index is not None:
                leases, res = self.index.expire(time.monotonic())
                if leases or res:
                    log.info("expired %d leases and %d reservations", leases, res)
                    self._end_gone(ok=False)

    def admit(self, m: store_wire.StoreManifest) -> str | None:
        """Why a client with manifest m cannot use this store (None: it can). The first one that can
        fixes the slot size."""
        if m.protocol_version != store_wire.STORE_PROTOCOL_VERSION:
            return f"protocol_version: store speaks {store_wire.STORE_PROTOCOL_VERSION}, client {m.protocol_version}"
        why = m.geometry_error()
        if why:
            return why
        if len(self.clients) >= self.cfg.max_clients:
            return f"max_clients: this store serves at most {self.cfg.max_clients} clients"
        if self.index is None:
            if m.page_bytes > self.memory_bytes:
                return (f"page_bytes: one canonical page is {m.page_bytes} bytes, more than memory_gb = "
                        f"{self.cfg.memory_gb} holds")
            self.slot_bytes = m.page_bytes
            self.shape_from = m.key_space()
            self.index = StoreIndex(self.memory_bytes // m.page_bytes, self.cfg.lease_s, self.cfg.reserve_s)
            log.info("slot size fixed at %d bytes by namespace %s: %d slots", m.page_bytes, self.shape_from,
                     self.index.num_slots)
            return None
        if m.page_bytes != self.slot_bytes:
            return (f"page_bytes: this store's slots hold {self.slot_bytes} bytes (fixed by its first client, "
                    f"namespace {self.shape_from}); this client's canonical page is {m.page_bytes} bytes: run "
                    f"another store for it")
        return None

    async def _on_conn(self, reader, writer) -> None:
        addr = writer.get_extra_info("peername")
        chan = store_wire.StoreChannel(reader, writer, self.secret, name=f"client@{addr}")
        try:
            hello, challenge = await chan.challenge(10)
        except (store_wire.ChannelClosed, TimeoutError, ConnectionError, OSError) as e:
            self.counters["unauthenticated"] += 1
            log.warning("connection from %s dropped before a valid hello: %s", addr, e)
            chan.close()
            return
        if not isinstance(hello, store_wire.StoreHello):
            self.counters["unauthenticated"] += 1
            log.warning("%s: first message was %s, not StoreHello; closing", chan.name, type(hello).__name__)
            chan.close()
            return
        chan.session(hello.nonce, challenge)
        why = self.admit(hello.manifest)
        if why is not None:
            self.counters["refused"] += 1
            log.error("refused client %s (%s): %s", hello.client, addr, why)
            try:
                await chan.send(store_wire.Refused(why))
            except (ConnectionError, OSError):
                pass
            chan.close()
            return
        try:
            await chan.send(store_wire.StoreWelcome(self.store_id, self.agent.name, self.agent.metadata(),
                                                    self.agent.bases[0], self.slot_bytes, self.index.num_slots,
                                                    self.cfg.lease_s, challenge, self.admin_port))
        except (ConnectionError, OSError):
            chan.close()
            return
        c = Client(next(self._ids), hello.client, str(addr), chan, hello.manifest, hello.manifest.key_space())
        self.clients[c.id] = c
        self.counters["connections"] += 1
        log.info("client %s connected from %s (namespace %s)", c.name, addr, c.ns)
        try:
            while True:
                msg = await chan.recv()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                await self._handle(c, msg)
        except store_wire.ChannelClosed as e:
            log.info("client %s gone: %s", c.name, e)
        finally:
            c.alive = False
            leases, res = self.index.release_owner(c.id)
            if leases or res:
                log.info("client %s: released its %d leases and %d reservations", c.name, leases, res)
                self._end_gone(ok=False)
            self.clients.pop(c.id, None)
            chan.close()

    async def _handle(self, c: Client, msg) -> None:
        idx, now = self.index, time.monotonic()
        if isinstance(msg, store_wire.Lookup):
            entries, lease = idx.lookup(c.ns, msg.hashes, now, msg.lease and c.alive, owner=c.id)
            c.counters["lookups"] += 1
            c.counters["hits"] += len(entries)
            c.counters["misses"] += len(msg.hashes) - len(entries)
            if lease:
                c.counters["bytes_out"] += len(entries) * self.slot_bytes
                self.counters["bytes_out"] += len(entries) * self.slot_bytes
                self.xfer_metrics.start("serve_read", c.name, key=(lease, len(entries) * self.slot_bytes))
            await c.chan.send(store_wire.Found(msg.id, [e.slot for e in entries], [e.checksum for e in entries], lease))
        elif isinstance(msg, store_wire.Reserve):
            rid, slots = idx.reserve(c.ns, msg.hashes, now, owner=c.id)
            c.counters["reserved"] += sum(1 for s in slots if s >= 0)
            if rid:
                self.xfer_metrics.start("accept_write", c.name, key=rid)
            await c.chan.send(store_wire.Reserved(msg.id, rid, slots))
        elif isinstance(msg, store_wire.Commit):
            task = asyncio.create_task(self._commit(c, msg))  # hashing runs off the loop; requests go on
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, store_wire.Release):
            lease = idx.leases.get(msg.lease)
            if lease is not None and lease.owner == c.id:
                idx.release(msg.lease)
                self._end_read(msg.lease, ok=True)
        elif isinstance(msg, store_wire.Abandon):
            r = idx.reservations.get(msg.reservation)
            if r is not None and r.owner == c.id:
                idx.abandon(msg.reservation)
                self.xfer_metrics.end("accept_write", ok=False, key=msg.reservation)
        elif isinstance(msg, store_wire.Corrupt):
            await self._corrupt(c, msg.hashes)
        elif isinstance(msg, store_wire.Ping):
            await c.chan.send(store_wire.Pong(msg.t))
        else:
            c.chan.reject(f"unexpected {type(msg).__name__}")

    async def _commit(self, c: Client, m: store_wire.Commit) -> None:
        idx = self.index
        r = idx.reservations.get(m.reservation)
        if len(m.hashes) != len(m.checksums) or r is None or r.owner != c.id:
            await self._send(c, store_wire.Committed(m.id, [False] * len(m.hashes)))
            return
        slots = [idx.reserved_slot(m.reservation, c.ns, h) for h in m.hashes]
        todo = [(i, s) for i, s in enumerate(slots) if s is not None]
        t0 = time.perf_counter()
        sums = await self._sums([s for _, s in todo])
        ms = (time.perf_counter() - t0) * 1e3
        self.verify_ms["n"] += 1
        self.verify_ms["total"] += ms
        self.verify_ms["max"] = max(self.verify_ms["max"], ms)
        verified = {m.hashes[i]: (m.checksums[i] if got == m.checksums[i] else None) for (i, _), got in zip(todo, sums)}
        result = idx.commit(m.reservation, verified)  # {} if it expired meanwhile: nothing committed
        ok = [result.get(h, False) for h in m.hashes]
        n, bad = sum(ok), sum(1 for v in verified.values() if v is None)
        self.xfer_metrics.end("accept_write", nbytes=n * self.slot_bytes, ok=bool(result) and not bad, key=m.reservation)
        c.counters["committed"] += n
        c.counters["rejected"] += bad
        c.counters["bytes_in"] += n * self.slot_bytes
        self.counters["bytes_in"] += n * self.slot_bytes
        if bad:
            log.warning("client %s: %d written pages did not match their checksums: dropped", c.name, bad)
        await self._send(c, store_wire.Committed(m.id, ok))

    def _end_read(self, lease: int, ok: bool) -> None:
        for key in self.xfer_metrics.open_keys("serve_read"):
            if key[0] == lease:
                self.xfer_metrics.end("serve_read", nbytes=key[1], ok=ok, key=key)

    def _end_gone(self, ok: bool) -> None:
        """Leases and reservations the index dropped (expired, or their client left): failed moves."""
        for key in self.xfer_metrics.open_keys("serve_read"):
            if key[0] not in self.index.leases:
                self.xfer_metrics.end("serve_read", ok=ok, key=key)
        for rid in self.xfer_metrics.open_keys("accept_write"):
            if rid not in self.index.reservations:
                self.xfer_metrics.end("accept_write", ok=ok, key=rid)

    async def _corrupt(self, c: Client, hashes: list[bytes]) -> None:
        """A client's read of these pages failed its checksum: drop the ones whose slot bytes are bad."""
        self.counters["corrupt_reports"] += len(hashes)
        c.counters["corrupt"] += len(hashes)
        idx = self.index
        entries = [e for e in (idx.keys.get((c.ns, h)) for h in hashes) if e is not None and e.state == COMMITTED]
        sums = await self._sums([e.slot for e in entries])
        for e, got in zip(entries, sums):
            if got != e.checksum and idx.keys.get(e.key) is e and idx.drop(*e.key):
                self.counters["corrupt_dropped"] += 1
                log.warning("slot %d (page %s) is corrupt: dropped", e.slot, e.key[1].hex()[:16])

    async def _send(self, c: Client, msg) -> None:
        try:
            await c.chan.send(msg)
        except (ConnectionError, OSError) as e:
            log.debug("send to %s: %s", c.name, e)

    async def _sums(self, slots: list[int]) -> list[bytes]:
        return await store_wire.checksums(self._checksums, slots)

    def _checksums(self, slots: list[int]) -> list[bytes]:
        sb = self.slot_bytes
        return [store_wire.checksum(self.mem[s * sb:(s + 1) * sb]) for s in slots]

    # -- debug hooks (TRND_STORE_DEBUG=1) -----------------------------------------------------------

    def debug_corrupt(self, h: bytes) -> int | None:
        """Flip one byte in the slot of committed page h (any namespace); the slot, or None."""
        e = self.index.find(h) if self.index is not None else None
        if e is None:
            return None
        off = e.slot * self.slot_bytes + self.slot_bytes // 2
        self.mem[off] ^= 0xFF
        return e.slot

    # -- inspection ---------------------------------------------------------------------------------

    def state(self) -> S.State:
        """The store's /admin/state (trnd/snapshot.py)."""
        idx = self.index
        stats = dataclasses.asdict(idx.stats) if idx is not None else {}
        return S.State(
            role="store", store_id=self.store_id, uptime_s=round(time.time() - self.started, 1),
            memory_bytes=self.memory_bytes, slot_bytes=self.slot_bytes or None,
            slots=S.Slots(**idx.counts()) if idx is not None else S.Slots(),
            leases=len(idx.leases) if idx is not None else 0,
            reservations=len(idx.reservations) if idx is not None else 0,
            namespaces=idx.namespaces() if idx is not None else {}, shape_from=self.shape_from,
            clients=[S.StoreClientView(id=c.id, name=c.name, addr=c.addr, namespace=c.ns,
                                        connected_s=round(time.time() - c.connected_at, 1), **c.counters)
                     for c in self.clients.values()],
            counters={**stats, **self.counters,
                      "verify_ms_avg": round(self.verify_ms["total"] / self.verify_ms["n"], 3)
                      if self.verify_ms["n"] else None,
                      "verify_ms_max": round(self.verify_ms["max"], 3)})

    def close(self) -> None:
        for c in list(self.clients.values()):
            c.chan.close()
        self.agent.close()
