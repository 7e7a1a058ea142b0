"""The role side of the L3 store: look up, read and write canonical pages in one or more `trnd store`s.

Called from an engine thread that must never block: every call returns a concurrent.futures.Future
at once, and the work runs on this client's own asyncio loop (a daemon thread). Every call has a
deadline; a store that is down, slow, refusing or returning bad bytes turns into a MISS (or "not
written"), never an error and never a hang. Dead stores are reconnected in the background with
backoff; a store that timed out is skipped (instant miss) for a growing while.

Placement: a page's owner is the store with the highest rendezvous weight blake2b(addr || hash), so
every client that lists the same addresses agrees on owners without talking to each other, and
adding or losing a store moves only that store's share. A lookup asks each owner for its pages (in
parallel) and counts the leading pages up to the first one its owner does not have.

Bytes: the store keeps the canonical layout (tp=1, every KV head); this client moves pages between
it and its own (maybe tensor-parallel) pools with transfer/plan.py plans, one batched NIXL transfer
per store and call. A page is named by its chained hash and checked by blake2b-128 of its canonical
bytes: computed here before a write (the store verifies before it serves the page) and recomputed
here over what a read brought in (a mismatch is a miss, reported to the store, which drops the slot
if its own bytes are bad).

Fences: a read whose deadline passes while its NIXL READ is still moving bytes resolves at once, but
the destination pages may still be written until NIXL says the transfer ended. They are listed by
`fenced()` until then: the caller must not hand them to anyone else before they leave that set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import itertools
import logging
import threading
import time
from collections import deque

import torch

from trnd.backends.omp import single_threaded
from trnd.http.ids import admin_url
from trnd.store import protocol as store_wire
from trnd.store.index import HAVE
from trnd.store.links import Links, Store, StoreDown
from trnd.transfer.inflight import InFlight
from trnd.transfer.metrics import TransferMetrics
from trnd.transfer.nixl import KVAgent
from trnd.transfer.plan import Layout, descriptors, make_plan

log = logging.getLogger("trnd.store.client")

class StoreClient(Links):
    def __init__(self, addrs: list[str], secret: bytes, agent: KVAgent, local: Layout, pools: list[torch.Tensor],
                 namespace: str, *, dtype: str, deadline_s: float = 1.0, write_deadline_s: float | None = None,
                 heartbeat_s: float = 1.0, peer_timeout_s: float = 3.0, metrics: TransferMetrics | None = None):
        """addrs: "host:port" of every store (the same list, spelled the same, on every client).
        local: this role's layout (its pools, one per rank); namespace: the page-hash namespace
        (Engine.namespace); dtype: the KV dtype's name (part of the store's key space)."""
        if not addrs:
            raise ValueError("StoreClient needs at least one store address")
        if len(pools) != len(local.rank_heads):
            raise ValueError(f"{len(pools)} pools for {len(local.rank_heads)} ranks")
        self.secret, self.agent, self.local, self.pools = secret, agent, local, pools
        self.xfer_metrics = metrics or TransferMetrics()  # per store: ops store_read, store_write
        self.deadline_s = deadline_s
        self.write_deadline_s = write_deadline_s or deadline_s
        self.heartbeat_s, self.peer_timeout_s = heartbeat_s, peer_timeout_s
        self.canonical = local.canonical()
        num_heads = self.canonical.rank_heads[0][1]
        self.page_bytes = self.canonical.page_bytes(0)
        self.read_plan = make_plan(self.canonical, local)
        self.write_plan = make_plan(local, self.canonical)
        self.manifest = store_wire.StoreManifest(namespace=namespace, dtype=dtype, num_layers=local.num_layers,
                                        num_kv_heads=num_heads, head_dim=local.head_dim, page_size=local.page_size,
                                        itemsize=local.itemsize, page_bytes=self.page_bytes,
                                        scale_bytes=local.scale_bytes, parts=local.parts, kind=local.kind)
        self._rows = []  # each rank's pool as [page, bytes]
        for r, p in enumerate(pools):
            rows = p.view(torch.uint8).reshape(p.shape[0], -1)
            if rows.shape[1] != local.page_bytes(r):
                raise ValueError(f"rank {r}: pool pages have {rows.shape[1]} bytes, the layout says "
                                 f"{local.page_bytes(r)}")
            self._rows.append(rows)
        self.stores = [Store(a, a.encode()) for a in addrs]
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards the latency window (read from other threads)
        self.inflight = InFlight(agent, "store")  # posted reads and writes; a read's pages fenced until it ends
        self._reaper: asyncio.Task | None = None
        self._sends: set[asyncio.Task] = set()
        self.counters = dict.fromkeys(("lookups", "reads", "writes", "timeouts", "failures"), 0)
        self._load_ms: deque[float] = deque(maxlen=256)
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trnd-store-client", daemon=True)
        self.thread.start()
        self._started.wait()

    # -- public API (any thread) --------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> concurrent.futures.Future:
        """-> int: how many leading pages the stores hold (0 on any failure or timeout). Takes no lease:
        a read that follows may find fewer."""
        self._check(hashes)
        return self._submit(self._lookup(list(hashes)), self.deadline_s, "lookups")

    def read(self, hashes: list[bytes], dst_pages: list[int]) -> concurrent.futures.Future:
        """-> int: how many leading pages were loaded into dst_pages and verified. Pages past that hold
        garbage; any of them in `fenced()` may still be written by a transfer that outlived the deadline."""
        self._check(hashes)
        if len(dst_pages) != len(hashes):
            raise ValueError(f"read: {len(hashes)} hashes, {len(dst_pages)} destination pages")
        return self._submit(self._read(list(hashes), list(dst_pages)), self.deadline_s, "reads")

    def write(self, hashes: list[bytes], src_pages: list[int]) -> concurrent.futures.Future:
        """-> int: how many of these pages the stores hold committed afterwards (written now or already
        there). The caller keeps src_pages unchanged (pool refs) until it resolves."""
        self._check(hashes)
        if len(src_pages) != len(hashes):
            raise ValueError(f"write: {len(hashes)} hashes, {len(src_pages)} source pages")
        return self._submit(self._write(list(hashes), list(src_pages)), self.write_deadline_s, "writes")

    def fenced(self) -> set[int]:
        """Local pages an unfinished NIXL READ may still write into: not to be reused yet."""
        return self.inflight.fenced()

    def owner(self, h: bytes) -> int:
        """Index of the store that owns page hash h (rendezvous hashing)."""
        return max(range(len(self.stores)),
                   key=lambda i: hashlib.blake2b(self.stores[i].key + h, digest_size=8).digest())

    def state(self) -> dict:
        with self._lock:
            lat = sorted(self._load_ms)
        fenced = len(self.inflight.fenced())
        now = time.monotonic()
        return {
            "stores": [{"addr": s.addr, "admin": admin_url(s.addr, s.welcome.admin_port if s.welcome else None),
                        "healthy": s.healthy and now >= s.slow_until,
                        "connected": s.healthy, "store_id": s.welcome.store_id if s.welcome else None,
                        "slots": s.welcome.num_slots if s.welcome else None, "error": s.error,
                        "refused": s.refused, "connects": s.connects, "restarts": s.restarts,
                        "skipped_s": round(max(0.0, s.slow_until - now), 3), **dict(s.counters)}
                       for s in self.stores],
            **dict(self.counters),
            "in_flight": len(self.inflight),
            "fenced_pages": fenced,
            "load_ms": {"n": len(lat), "p50": round(lat[len(lat) // 2], 3) if lat else None,
                        "max": round(lat[-1], 3) if lat else None},
        }

    def close(self) -> None:
        if self.loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        try:
            fut.result(5)
        except Exception as e:
            log.debug("store client shutdown: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()
        for s in self.stores:
            if s.peer:
                self.agent.remove_peer(s.peer)

    # -- loop plumbing ------------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        # checksum threads gather pages with torch: single-threaded, no OpenMP pools beside the engine's
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
            store_wire.CHECKSUM_THREADS, "trnd-store-checksum", initializer=single_threaded))
        for s in self.stores:
            self.loop.create_task(self._store_task(s))
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in self.stores:
            if s.chan is not None:
                s.chan.close()
        self.inflight.cancel_all()

    def _check(self, hashes) -> None:
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != 32:
                raise ValueError("page hashes are 32-byte digests (cache/hashing.py)")

    def _submit(self, coro, deadline: float, what: str) -> concurrent.futures.Future:
        self.counters[what] += 1
        return asyncio.run_coroutine_threadsafe(self._guard(coro, deadline, what), self.loop)

    async def _guard(self, coro, deadline: float, what: str) -> int:
        try:
            async with asyncio.timeout(deadline):
                return await coro
        except TimeoutError:
            self.counters["timeouts"] += 1
            log.debug("store %s: deadline of %.2f s passed: miss", what, deadline)
        except Exception as e:  # whatever went wrong, the caller sees a miss
            self.counters["failures"] += 1
            log.warning("store %s failed (%s: %s): miss", what, type(e).__name__, e)
        return 0

    # -- placement ----------------------------------------------------------------------------------

    def _groups(self, hashes: list[bytes]) -> dict[int, list[int]]:
        """store index -> positions of the hashes it owns, in prefix order."""
        out: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            out.setdefault(self.owner(h), []).append(i)
        return out

    async def _lookup_all(self, hashes: list[bytes], lease: bool, timeout: float):
        """Ask every owner in parallel. Returns (leading count, {store: (positions, Found | None)})."""
        groups = self._groups(hashes)

        async def one(si: int, pos: list[int]):
            s = self.stores[si]
            try:
                found = await self._request(s, store_wire.Lookup(next(self._ids), [hashes[i] for i in pos], lease),
                                            timeout)
            except (StoreDown, TimeoutError):
                s.counters["misses"] += len(pos)
                return None
            s.counters["lookups"] += 1
            s.counters["hits"] += len(found.slots)
            s.counters["misses"] += len(pos) - len(found.slots)
            return found

        items = list(groups.items())
        results = await asyncio.gather(*(one(si, pos) for si, pos in items))
        per = {si: (pos, f) for (si, pos), f in zip(items, results)}
        n = len(hashes)
        for pos, f in per.values():
            k = len(f.slots) if f is not None else 0
            if k < len(pos):
                n = min(n, pos[k])
        return n, per

    # -- operations (on the loop) -------------------------------------------------------------------

    async def _lookup(self, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        n, _ = await self._lookup_all(hashes, False, self.deadline_s)
        return n

    async def _read(self, hashes: list[bytes], dst: list[int]) -> int:
        if not hashes:
            return 0
        t0 = time.monotonic()
        leases: list[tuple[Store, int]] = []
        try:
            lookup = self._lookup_all(hashes, True, self.deadline_s * 0.5)
            task = asyncio.ensure_future(lookup)
            try:
                n, per = await asyncio.shield(task)
            except asyncio.CancelledError:  # the deadline hit mid-lookup: release what the stores granted
                task.add_done_callback(lambda t: self._release_all(t))
                raise
            for si, (_, f) in per.items():
                if f is not None and f.lease:
                    leases.append((self.stores[si], f.lease))
            if n == 0:
                return 0
            expected: list[bytes] = [b""] * n
            jobs = []
            for si, (pos, f) in per.items():
                if f is None:
                    continue
                take = [j for j, p in enumerate(pos[:len(f.slots)]) if p < n]
                if not take:
                    continue
                for j in take:
                    expected[pos[j]] = f.checksums[j]
                s = self.stores[si]
                local = [dst[pos[j]] for j in take]
                src, dstd = descriptors(self.read_plan, self.canonical, self.local, [s.welcome.region_addr],
                                        self.agent.bases, [f.slots[j] for j in take], local)
                try:
                    handle = self.agent.read(s.peer, dstd, src)
                except ConnectionError as e:
                    self.xfer_metrics.failed("store_read", s.addr)
                    log.warning("%s", e)
                    n = min(n, pos[take[0]])
                    continue
                jobs.append((s, [pos[j] for j in take], self._track(handle, local, "store_read", s.addr,
                                                                    len(take) * self.page_bytes)))
            for s, positions, fut in jobs:
                state = await fut
                if state != "DONE":
                    s.counters["errors"] += 1
                    n = min(n, positions[0])
            if n == 0:
                return 0
            sums = await self._sums(dst[:n])
            good = n
            for i in range(n):
                if sums[i] != expected[i]:
                    s = self.stores[self.owner(hashes[i])]
                    s.counters["corrupt"] += 1
                    log.warning("store %s: page %s failed its checksum after the read: dropped (miss)", s.addr,
                                hashes[i].hex()[:16])
                    self._send_soon(s, store_wire.Corrupt([hashes[i]]))
                    good = min(good, i)
            for i in range(good):
                s = self.stores[self.owner(hashes[i])]
                s.counters["pages_loaded"] += 1
                s.counters["bytes_in"] += self.page_bytes
            with self._lock:
                self._load_ms.append((time.monotonic() - t0) * 1e3)
            return good
        finally:
            for s, lease in leases:
                self._send_soon(s, store_wire.Release(lease))

    def _release_all(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        _, per = task.result()
        for si, (_, f) in per.items():
            if f is not None and f.lease:
                self._send_soon(self.stores[si], store_wire.Release(f.lease))

    async def _write(self, hashes: list[bytes], src: list[int]) -> int:
        if not hashes:
            return 0
        groups = self._groups(hashes)
        counts = await asyncio.gather(*(self._write_one(self.stores[si], pos, hashes, src)
                                        for si, pos in groups.items()))
        return sum(counts)

    async def _write_one(self, s: Store, pos: list[int], hashes: list[bytes], src: list[int]) -> int:
        rid, have, committed, xfer = 0, 0, False, None
        try:
            r = await self._request(s, store_wire.Reserve(next(self._ids), [hashes[i] for i in pos]),
                                    self.write_deadline_s)
            rid = r.reservation
            have = sum(1 for x in r.slots if x == HAVE)
            s.counters["pages_present"] += have
            todo = [(pos[j], slot) for j, slot in enumerate(r.slots) if slot >= 0]
            if not todo:
                return have
            local = [src[i] for i, _ in todo]
            sd, dd = descriptors(self.write_plan, self.local, self.canonical, self.agent.bases,
                                 [s.welcome.region_addr], local, [slot for _, slot in todo])
            try:
                handle = self.agent.write(s.peer, sd, dd, b"")
            except ConnectionError as e:
                self.xfer_metrics.failed("store_write", s.addr)
                log.warning("%s", e)
                return have
            xfer = self._track(handle, [], "store_write", s.addr, len(local) * self.page_bytes)
            sums = await self._sums(local)  # while the bytes move (the caller keeps the pages unchanged)
            if await xfer != "DONE":
                s.counters["errors"] += 1
                return have
            c = await self._request(s, store_wire.Commit(next(self._ids), rid, [hashes[i] for i, _ in todo], sums),
                                    self.write_deadline_s)
            committed = True
            n = sum(c.ok)
            s.counters["pages_stored"] += n
            s.counters["bytes_out"] += n * self.page_bytes
            if n < len(todo):
                log.warning("store %s rejected %d of %d written pages (checksum)", s.addr, len(todo) - n, len(todo))
            return have + n
        except (StoreDown, TimeoutError):
            return have
        finally:
            if rid and not committed:
                if xfer is not None and not xfer.done():  # bytes may still land: free the slots after
                    xfer.add_done_callback(lambda _f: self._send_soon(s, store_wire.Abandon(rid)))
                else:
                    self._send_soon(s, store_wire.Abandon(rid))

    # -- transfers and bytes ------------------------------------------------------------------------

    def _track(self, handle, pages: list[int], op: str, peer: str, nbytes: int) -> asyncio.Future:
        """A posted NIXL transfer; the future gets 'DONE' or 'ERR'. `pages` stay fenced until then, whoever
        stopped waiting for the future (transfer/inflight.py). Counted in the transfer metrics when it ends."""
        t0 = self.xfer_metrics.start(op, peer)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: self.xfer_metrics.end(
            op, peer, nbytes, ok=not f.cancelled() and f.result() == "DONE", t0=t0))
        self.inflight.post(handle, pages, nbytes, key=fut, t0=t0)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return fut

    async def _reap(self) -> None:
        while self.inflight:
            await asyncio.sleep(0.0005)
            for x, ok in self.inflight.reap():
                if not x.key.done():
                    x.key.set_result("DONE" if ok else "ERR")

    async def _sums(self, pages: list[int]) -> list[bytes]:
        return await store_wire.checksums(self._checksums, pages)

    def _checksums(self, pages: list[int]) -> list[bytes]:
        """blake2b-128 of each local page's canonical bytes (gathered from every rank's pool)."""
        if not pages:
            return []
        idx = torch.tensor(pages, dtype=torch.long)
        buf = torch.empty((len(pages), self.page_bytes), dtype=torch.uint8)
        for g in self.write_plan:
            rows = self._rows[g.src_rank]
            buf[:, g.dst_off:g.dst_off + g.length] = rows[idx.to(rows.device), g.src_off:g.src_off + g.length].cpu()
        data = buf.numpy()
        return [store_wire.checksum(data[i]) for i in range(len(pages))]
