"""Continuous batching with chunked prefill, as plain Python over queues, free pages and a token budget.

Each step: running requests first (decodes, then unfinished prefill chunks), then admissions from the
waiting queue while the token budget, the batch limit and the free pages allow. Pages are checked,
then committed; when they run out, cached-only pages are evicted from the radix cache, and after that
the youngest running request is preempted (its KV released to the cache, recomputed later).
No torch here: the scheduler decides, the runner computes.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from dataclasses import dataclass, field

from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache
from trnd.engine.request import Req, Status


@dataclass
class SchedulerConfig:
    page_size: int = 16
    max_batch: int = 32  # running requests (decode batch) at most
    token_budget: int = 512  # tokens computed per step (decode tokens + prefill chunk tokens)
    chunk_size: int = 512  # prefill tokens of one request per step
    prefix_cache: bool = True


@dataclass
class Batch:
    decode: list[Req] = field(default_factory=list)  # one token each
    prefill: list[tuple[Req, int]] = field(default_factory=list)  # (request, tokens this step)
    preempted: list[Req] = field(default_factory=list)
    remote: list[Req] = field(default_factory=list)  # admitted with pages reserved; KV comes from a prefill peer

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


@dataclass
class TierLoad:
    """A request parked while a lower tier brings the pages after its device hit: host L2 (a copy on the
    load thread) or the remote store L3 (a lookup, then a read). The batch keeps stepping meanwhile."""
    req: Req
    hashes: list[bytes]
    fut: concurrent.futures.Future
    pages: list[int] = field(default_factory=list)  # allocated for the copy, owned here until it resolves
    tier: str = "remote"  # "host" or "remote"
    aborted: bool = False


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: PagePool, radix: RadixCache, remote_prefill: bool = False):
        self.cfg, self.pool, self.radix = cfg, pool, radix
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Disaggregated decode: a new request's prompt KV is written into pages reserved here by a
        # prefill server; it waits in `transferring` until that KV has landed (see roles/decode.py).
        # Preempted requests (which already have output) are recomputed locally as usual.
        self.remote_prefill = remote_prefill
        self.transferring: dict[str, Req] = {}
        self.tiers = None  # cache/tiers.py: lower tiers asked for the pages after a device hit
        self.loading: dict[str, TierLoad] = {}  # parked on a host (L2) copy or a remote (L3) lookup/read
        self._probed: set[str] = set()  # asked L3 once already (a miss is not asked again)
        self._locks: dict[str, object] = {}  # rid -> radix node locked for its borrowed prefix

    # -- queue operations ---------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Req, reason: str) -> None:
        """Done (eos/length/stop/abort): its full pages go to the prefix cache, the rest are freed.
        A request still `transferring` must be fenced by the caller first (remote writes may land)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.transferring.pop(req.rid, None)
        self._probed.discard(req.rid)
        job = self.loading.get(req.rid)
        if job is not None:  # a remote read may still write into its pages: released when it resolves
            job.aborted = True
        else:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def find(self, rid: str) -> Req | None:
        if rid in self.transferring:
            return self.transferring[rid]
        if rid in self.loading and not self.loading[rid].aborted:
            return self.loading[rid].req
        return next((r for r in (*self.running, *self.waiting) if r.rid == rid), None)

    def kv_arrived(self, req: Req) -> None:
        """The prompt's KV is in req.pages: it joins the running batch as a decode."""
        del self.transferring[req.rid]
        req.num_computed = req.num_prompt
        req.status = Status.RUNNING
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        """Anything to schedule: queued, running, or parked on a remote load (whose progress is checked
        by schedule()). Transferring requests wait on a prefill server: their role polls for them."""
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.transferring) + len(self.loading)

    # -- the step -----------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.cfg.token_budget
        if self.tiers is not None:
            self.tiers.poll()
            if self.loading:
                self._advance_loads()
        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this loop to make room
                continue
            n = self._chunk(req, budget)
            if n == 0:
                continue
            if not self._make_room(req, n, batch):
                continue
            budget -= n
            if req.is_prefilling:
                batch.prefill.append((req, n))
            else:
                batch.decode.append(req)
        while self.waiting and budget > 0 and self.num_active < self.cfg.max_batch:
            req = self.waiting[0]
            if self._kv_from_peer(req):
                admitted = self._admit(req, req.num_prompt, whole=True)  # all prompt pages, reserved up front
                if admitted is None:  # parked on a host-tier copy
                    self.waiting.popleft()
                    continue
                if not admitted:
                    break
                self.waiting.popleft()
                req.status = Status.RUNNING
                self.transferring[req.rid] = req
                batch.remote.append(req)
                continue
            admitted = self._admit(req, budget)
            if admitted is None:  # parked on a lower tier
                self.waiting.popleft()
                continue
            if not admitted:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = self._chunk(req, budget)
            budget -= n
            batch.prefill.append((req, n))
        return batch

    def _chunk(self, req: Req, budget: int) -> int:
        return min(req.num_uncomputed, budget, self.cfg.chunk_size)

    def _pages_needed(self, req: Req, n: int) -> int:
        total = -(-(req.num_computed + n) // self.cfg.page_size)
        return max(0, total - len(req.pages))

    def _reserve(self, need: int) -> bool:
        """Make `need` pages free, evicting cached-only pages if necessary. Check, then commit."""
        if self.pool.num_free < need:
            self.radix.evict(need - self.pool.num_free)
        return self.pool.num_free >= need

    def _make_room(self, req: Req, n: int, batch: Batch) -> bool:
        need = self._pages_needed(req, n)
        while not self._reserve(need):
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        req.pages += self.pool.alloc(need)
        return True

    def _admit(self, req: Req, budget: int, whole: bool = False) -> bool | None:
        """True: pages for its next chunk are committed. False: not now. None: parked on a lower tier."""
        if req.num_computed == 0 and self.cfg.prefix_cache:
            # Match on all but the last token: at least one token must run to produce logits.
            m = self.radix.match(req.all_ids[:-1])
            if m.pages:
                self.radix.lock(m.node)
                self._locks[req.rid] = m.node
                self.pool.ref(m.pages)
                req.pages = list(m.pages)
                req.num_locked_pages = len(m.pages)
            req.num_cached = req.num_computed = m.num_tokens
            if self.tiers is not None and (self._load_host(req) or (not whole and self._ask_remote(req))):
                return None
        need = self._pages_needed(req, req.num_uncomputed if whole else self._chunk(req, budget))
        if self._reserve(need):
            req.pages += self.pool.alloc(need)
            return True
        self._release(req)  # give back what the match borrowed; try again next step
        return False

    def _load_host(self, req: Req) -> bool:
        """Park the request while the host tier copies the pages after its device hit (instead of
        recomputing them); the batch keeps stepping."""
        hashes = self.tiers.hashes(req.all_ids[:-1])[len(req.pages):]
        k = self.tiers.host_probe(hashes)
        if not k or not self._reserve(k):
            return False
        pages = self.pool.alloc(k)
        self.loading[req.rid] = TierLoad(req, hashes, self.tiers.host_load(hashes[:k], pages), pages, tier="host")
        return True

    def _ask_remote(self, req: Req) -> bool:
        """Park the request while L3 is asked for the full pages after its local hits."""
        if self.tiers.remote is None or req.rid in self._probed:
            return False
        self._probed.add(req.rid)
        hashes = self.tiers.hashes(req.all_ids[:-1])[len(req.pages):]
        if not hashes:
            return False
        self.loading[req.rid] = TierLoad(req, hashes, self.tiers.remote_lookup(hashes))
        return True

    def _advance_loads(self) -> None:
        """Host copy done -> take the pages, then ask L3 for what follows. Remote lookup done -> allocate
        and read; read done -> take the pages. Then the request goes back to the queue's front with
        whatever arrived (a miss, a dead or slow store: simply less cached)."""
        for rid, job in list(self.loading.items()):
            if not job.fut.done():
                continue
            n = job.fut.result() if job.fut.exception() is None else 0
            if job.tier == "remote" and not job.pages and not job.aborted and n > 0 and self._reserve(n):
                job.pages = self.pool.alloc(n)
                job.fut = self.tiers.remote_read(job.hashes[:n], job.pages)
                continue
            del self.loading[rid]
            req = job.req
            loaded = 0 if job.aborted or not job.pages else n
            if job.tier == "host":
                self.pool.unref(job.pages[loaded:])
            elif job.pages:
                self.tiers.settle_read(job.pages, loaded)
            req.pages += job.pages[:loaded]
            req.num_cached = req.num_computed = req.num_computed + loaded * self.cfg.page_size
            req.num_loaded += loaded * self.cfg.page_size
            if job.aborted:
                self._release(req)
                continue
            if job.tier == "host" and not self._kv_from_peer(req) and self._ask_remote(req):
                continue  # parked again, now on L3 for the pages after these
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def _kv_from_peer(self, req: Req) -> bool:
        """Disaggregated decode: a new request's prompt KV comes from a prefill server, not from here."""
        return self.remote_prefill and req.num_output == 0

    def preempt(self, req: Req) -> None:
        """Recompute later: release the KV (to the cache, where it may still be found) and requeue first."""
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        if req.pages and self.cfg.prefix_cache:
            full = req.num_computed // self.cfg.page_size
            if full:
                tokens = req.all_ids[: full * self.cfg.page_size]
                self.radix.insert(tokens, req.pages[:full])
                if self.tiers is not None:
                    self.tiers.on_release(tokens, req.pages[:full])
        node = self._locks.pop(req.rid, None)
        if node is not None:
            self.radix.unlock(node)
        if req.pages:
            self.pool.unref(req.pages)
        req.pages = []
        req.num_locked_pages = 0
        req.num_computed = 0
