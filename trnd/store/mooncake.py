"""Mooncake Store as the L3 tier, beside `trnd store` (the embedded default): the same contract as
store/client.py StoreClient (lookup, read, write, fenced, state, close; every call a future with a
deadline, any failure a miss), over `mooncake.store.MooncakeDistributedStore` (the optional extra
`mooncake`: pip install 'trnd[mooncake]'; a master the operator runs, `mooncake_master`).

Keys: "trnd/<model>/<geometry>/<page hash>": the model fingerprint (config, tokenizer, weights and KV
dtype: Engine.namespace) and the page geometry spelled out (so one model's pages can be listed or
dropped by prefix), then trnd's chained page hash, whose chain starts at the namespace and the cache
salt (cache/hashing.py): no page is found across models, layouts or tenants. Values: the canonical page
(tp=1, every KV head, as `trnd store` keeps it) followed by its blake2b-128 checksum, checked on every
read: a mismatch is a miss, counted (`corrupt`), and the key is removed (forced past our read's lease). Leases, replicas and eviction
are Mooncake's (objects are immutable: a put of a present key changes nothing).

Mooncake's calls block in C++ (a dead master costs seconds per call: a put retried ~4 s in our
measurement), so they run on this client's own threads and the caller's future resolves at the
deadline whatever they do: a miss, a logged and counted error, never a hang. Pages are touched only
under a lock that the deadline takes too: a read scatters into the caller's pages only while its
future is unresolved, and a write copies its pages out before its future can resolve, so `fenced()`
is always empty.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
from collections import deque

import torch

from trnd.backends.omp import single_threaded
from trnd.store.protocol import checksum
from trnd.transfer.metrics import TransferMetrics
from trnd.transfer.plan import Layout, make_plan

log = logging.getLogger("trnd.store.mooncake")

CHECKSUM_BYTES = 16
THREADS = 2
_ABANDONED: list = []  # clients of a dead master: closing them would block the process (MooncakeTier.close)


def load_store_class():
    """MooncakeDistributedStore, or a one-line error saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise RuntimeError(f"remote backend 'mooncake' needs the mooncake extra (pip install "
                           f"'trnd[mooncake]', i.e. mooncake-transfer-engine-non-cuda, and Debian's libibverbs1 "
                           f"and librdmacm1): {e}") from None
    return MooncakeDistributedStore


class _Op:
    """One call's future and the lock its worker and its deadline share."""

    def __init__(self, deadline_s: float, on_expire):
        self.fut: concurrent.futures.Future = concurrent.futures.Future()
        self.lock = threading.Lock()
        self.timer = threading.Timer(deadline_s, self._expire, (on_expire,))
        self.timer.daemon = True
        self.timer.start()

    def _expire(self, on_expire) -> None:
        with self.lock:
            if not self.fut.done():
                self.fut.set_result(0)
                on_expire()

    def settle(self, n: int) -> bool:
        """Caller holds self.lock. False when the deadline came first."""
        self.timer.cancel()
        if self.fut.done():
            return False
        self.fut.set_result(n)
        return True


class MooncakeTier:
    def __init__(self, remote, local: Layout, pools: list[torch.Tensor], namespace: str, *, dtype: str,
                 deadline_s: float = 1.0, metrics: TransferMetrics | None = None, store=None):
        """remote: config.RemoteConfig (master, metadata server, protocol, segment and buffer sizes); store:
        an already set-up MooncakeDistributedStore (tests), else one is made and set up here."""
        self.cfg, self.local, self.pools, self.deadline_s = remote, local, pools, deadline_s
        self.xfer_metrics = metrics or TransferMetrics()
        self.canonical = local.canonical()
        num_heads = self.canonical.rank_heads[0][1]
        self.page_bytes = self.canonical.page_bytes(0)
        self.read_plan = make_plan(self.canonical, local)
        self.write_plan = make_plan(local, self.canonical)
        self._rows = [p.view(torch.uint8).reshape(p.shape[0], -1) for p in pools]
        geometry = (f"{dtype}.L{local.num_layers}.H{num_heads}.D{local.head_dim}.P{local.page_size}"
                    f".B{local.itemsize}.S{local.scale_bytes}" + ("" if local.kind == "gqa" else f".{local.kind}"))
        model = hashlib.blake2b(namespace.encode(), digest_size=8).hexdigest()
        self.prefix = f"trnd/{model}/{geometry}/"
        self.addr = remote.master
        self.counters = dict.fromkeys(("lookups", "reads", "writes", "timeouts", "failures"), 0)
        self.link = dict.fromkeys(("lookups", "hits", "misses", "pages_loaded", "bytes_in", "pages_stored",
                                   "pages_present", "bytes_out", "timeouts", "errors", "corrupt"), 0)
        self.error: str | None = None
        self._errors_logged = 0
        self._load_ms: deque[float] = deque(maxlen=256)
        self._inflight = 0
        self._stat_lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(THREADS, "trnd-mooncake", initializer=single_threaded)
        if store is None:
            store = load_store_class()()
            rc = store.setup(remote.local_hostname, remote.metadata_server, int(remote.segment_gb * 2**30),
                             int(remote.buffer_gb * 2**30), remote.protocol, remote.device, remote.master)
            if rc != 0:
                raise RuntimeError(f"remote backend 'mooncake': setup with master {remote.master} and metadata "
                                   f"{remote.metadata_server} failed (rc {rc}): is mooncake_master running there?")
        self.store = store
        log.info("L3 on Mooncake Store: master %s, keys %s<page hash>", remote.master, self.prefix)

    # -- the tier's contract (any thread) -----------------------------------------------------------

    def key(self, h: bytes) -> str:
        return self.prefix + h.hex()

    def lookup(self, hashes: list[bytes]):
        """-> int: how many leading pages Mooncake holds (0 on any failure or at the deadline)."""
        return self._submit("lookups", self._lookup, list(hashes))

    def read(self, hashes: list[bytes], dst_pages: list[int]):
        """-> int: how many leading pages were loaded into dst_pages and verified."""
        if len(dst_pages) != len(hashes):
            raise ValueError(f"read: {len(hashes)} hashes, {len(dst_pages)} destination pages")
        return self._submit("reads", self._read, list(hashes), list(dst_pages))

    def write(self, hashes: list[bytes], src_pages: list[int]):
        """-> int: how many of these pages Mooncake holds afterwards. src_pages are copied out before the
        future resolves (the caller's refs keep them unchanged until then)."""
        if len(src_pages) != len(hashes):
            raise ValueError(f"write: {len(hashes)} hashes, {len(src_pages)} source pages")
        return self._submit("writes", self._write, list(hashes), list(src_pages))

    def fenced(self) -> set[int]:
        return set()  # nothing writes into a page after its future resolved (the lock in _Op)

    def state(self) -> dict:
        with self._stat_lock:
            lat = sorted(self._load_ms)
        healthy = self.error is None
        return {"stores": [{"addr": f"mooncake://{self.addr}", "healthy": healthy, "connected": healthy,
                            "error": self.error, **self.link}],
                **self.counters, "in_flight": self._inflight, "fenced_pages": 0,
                "load_ms": {"n": len(lat), "p50": round(lat[len(lat) // 2], 3) if lat else None,
                            "max": round(lat[-1], 3) if lat else None}}

    def close(self) -> None:
        """Mooncake's close unmounts this client's segment at the master and holds the GIL meanwhile: with the
        master gone that froze the whole process for ~12 s here. So a client whose last call failed is not
        closed but kept aside (the process exit pays it, once); a healthy one is closed on its own thread."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.error is not None:
            log.warning("mooncake: master %s unreachable at close (%s): its client is left to the process exit",
                        self.addr, self.error)
            _ABANDONED.append(self.store)
            return
        t = threading.Thread(target=self.store.close, name="trnd-mooncake-close", daemon=True)
        t.start()
        t.join(5)

    # -- plumbing -------------------------------------------------------------------------------------

    def _submit(self, what: str, fn, *args):
        self.counters[what] += 1
        op = _Op(self.deadline_s, lambda: self._expired(what))
        with self._stat_lock:
            self._inflight += 1
        self.pool.submit(self._run, op, what, fn, *args)
        return op.fut

    def _run(self, op: _Op, what: str, fn, *args) -> None:
        try:
            fn(op, *args)
        except Exception as e:
            self._failed(what, e)
            with op.lock:
                op.settle(0)
        finally:
            with self._stat_lock:
                self._inflight -= 1

    def _expired(self, what: str) -> None:
        self.counters["timeouts"] += 1
        self.link["timeouts"] += 1
        log.debug("mooncake %s: deadline of %.2f s passed: miss", what, self.deadline_s)

    def _failed(self, what: str, e: BaseException | str) -> None:
        self.counters["failures"] += 1
        self.link["errors"] += 1
        self.error = f"{what}: {e}"
        self._errors_logged += 1
        if self._errors_logged == 1 or self._errors_logged % 100 == 0:
            log.warning("mooncake %s failed (%s; %d errors so far): a miss", what, e, self._errors_logged)

    def _ok(self) -> None:
        if self.error is not None:
            log.info("mooncake: master %s answers again", self.addr)
        self.error = None

    def _present(self, hashes: list[bytes]) -> int:
        """Leading pages present (batch_is_exist: 1 yes, 0 no, < 0 an error)."""
        got = self.store.batch_is_exist([self.key(h) for h in hashes])
        if any(x < 0 for x in got):
            raise RuntimeError(f"batch_is_exist returned {min(got)} (master unreachable?)")
        n = next((i for i, x in enumerate(got) if x != 1), len(got))
        self.link["lookups"] += 1
        self.link["hits"] += n
        self.link["misses"] += len(hashes) - n
        return n

    def _lookup(self, op: _Op, hashes: list[bytes]) -> None:
        n = self._present(hashes) if hashes else 0
        self._ok()
        with op.lock:
            op.settle(n)

    def _read(self, op: _Op, hashes: list[bytes], dst: list[int]) -> None:
        t0 = time.monotonic()
        # get_batch answers b"" for a missing key and for a master that is gone alike: ask which are there first
        present = self._present(hashes) if hashes else 0
        tx = self.xfer_metrics.start("store_read", self.addr)
        values = self.store.get_batch([self.key(h) for h in hashes[:present]]) if present else []
        n = 0
        for i, v in enumerate(values):
            if len(v) != self.page_bytes + CHECKSUM_BYTES:
                break  # missing (b"") or of another size
            if checksum(memoryview(v)[:self.page_bytes]) != bytes(v[self.page_bytes:]):
                self.link["corrupt"] += 1
                log.warning("mooncake: page %s failed its checksum: dropped (miss)", hashes[i].hex()[:16])
                self.pool.submit(self.store.remove, self.key(hashes[i]), True)  # force: our read's lease
                break
            n += 1
        buf = torch.frombuffer(bytearray(b"".join(bytes(v[:self.page_bytes]) for v in values[:n])),
                               dtype=torch.uint8).reshape(n, self.page_bytes) if n else None
        self._ok()
        with op.lock:
            if op.fut.done():
                self.xfer_metrics.end("store_read", self.addr, 0, ok=False, t0=tx)
                return
            if n:
                idx = torch.tensor(dst[:n], dtype=torch.long)
                for g in self.read_plan:
                    rows = self._rows[g.dst_rank]
                    rows[idx.to(rows.device), g.dst_off:g.dst_off + g.length] = \
                        buf[:, g.src_off:g.src_off + g.length].to(rows.device)
            op.settle(n)
        self.link["pages_loaded"] += n
        self.link["bytes_in"] += n * self.page_bytes
        self.xfer_metrics.end("store_read", self.addr, n * self.page_bytes, ok=True, t0=tx)
        with self._stat_lock:
            self._load_ms.append((time.monotonic() - t0) * 1e3)

    def _write(self, op: _Op, hashes: list[bytes], src: list[int]) -> None:
        with op.lock:  # copy the pages out before the caller may let go of them
            if op.fut.done():
                return
            idx = torch.tensor(src, dtype=torch.long)
            buf = torch.empty((len(src), self.page_bytes), dtype=torch.uint8)
            for g in self.write_plan:
                rows = self._rows[g.src_rank]
                buf[:, g.dst_off:g.dst_off + g.length] = rows[idx.to(rows.device), g.src_off:g.src_off + g.length].cpu()
        data = buf.numpy()
        have = self._present(hashes)  # a chain's leading pages are often there already (a session's history)
        keys, values = [], []
        for i in range(have, len(hashes)):
            keys.append(self.key(hashes[i]))
            values.append(data[i].tobytes() + checksum(data[i]))
        tx = self.xfer_metrics.start("store_write", self.addr)
        rc = self.store.put_batch(keys, values) if keys else 0
        if rc != 0:
            self.xfer_metrics.end("store_write", self.addr, 0, ok=False, t0=tx)
            raise RuntimeError(f"put_batch returned {rc}")
        self.xfer_metrics.end("store_write", self.addr, len(keys) * self.page_bytes, ok=True, t0=tx)
        self.link["pages_present"] += have
        self.link["pages_stored"] += len(keys)
        self.link["bytes_out"] += len(keys) * self.page_bytes
        self._ok()
        with op.lock:
            op.settle(len(hashes))
