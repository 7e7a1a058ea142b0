"""Continuous batching with chunked prefill, as plain Python over queues, free pages and a token budget.

Each step: running requests first (decodes, then unfinished prefill chunks), then admissions from the
waiting queue while the token budget, the batch limit and the free pages allow. Pages are checked,
then committed; when they run out, cached-only pages are evicted from the radix cache, and after that
the lowest-ranked running request is preempted: its full pages go to the radix cache, from there to L2
when evicted (write-back), and at re-admission they are found on the device or loaded back from L2
(engine/parked.py) instead of being recomputed; only its last partial page is recomputed.

Priorities (vLLM's `priority` field, lower first): the waiting queue admits the best-ranked request,
FCFS among equals (a preempted or requeued request keeps its place at the front); a waiting request
that ranks above the worst running one while the batch is full or short of pages preempts it; the
worst-ranked running request is the preemption victim. Bounded: a waiting request that later, better
requests were admitted past `max_overtakes` times ranks above every priority, so a low priority still
finishes. With one priority for all, this is the FCFS scheduler it was.
No torch here: the scheduler decides, the runner computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from trnd.cache.pages import PagePool
from trnd.engine import trace
from trnd.cache.radix import RadixCache
from trnd.engine.parked import Landing, Parked, TierLoad, ask_remote, load_host
from trnd.engine.request import Req, Status


@dataclass
class SchedulerConfig:
    page_size: int = 16
    max_batch: int = 32  # running requests (decode batch) at most
    token_budget: int = 512  # tokens computed per step (decode tokens + prefill chunk tokens)
    chunk_size: int = 512  # prefill tokens of one request per step
    prefix_cache: bool = True
    max_overtakes: int = 64  # admissions past a waiting request before it ranks above every priority


@dataclass
class Batch:
    decode: list[Req] = field(default_factory=list)  # one token each
    prefill: list[tuple[Req, int]] = field(default_factory=list)  # (request, tokens this step)
    preempted: list[Req] = field(default_factory=list)
    arrived: list[tuple[Req, Landing]] = field(default_factory=list)  # a peer's KV and first token are in
    failed: list[tuple[Req, BaseException]] = field(default_factory=list)  # its source gave up: out of the engine

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(1 + len(r.draft_ids) for r in self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: PagePool, radix: RadixCache):
        self.cfg, self.pool, self.radix = cfg, pool, radix
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.tiers = None  # cache/tiers.py: lower tiers asked for the pages after a device hit
        # Disaggregated decode: where a new request's prompt KV comes from (roles/decode.py: a prefill
        # peer writes it into the pages reserved here; None: computed here after all, its prompt short
        # enough). Preempted requests (which already have output) are recomputed locally as usual.
        self.peer: Callable[[Req], Parked | None] | None = None
        self.parked: dict[str, Parked] = {}  # every request whose KV comes from elsewhere (engine/parked.py)
        self._probed: set[str] = set()  # asked L3 once already (a miss is not asked again)
        self._locks: dict[str, object] = {}  # rid -> radix node locked for its borrowed prefix

    # -- queue operations ---------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def finish(self, req: Req, reason: str) -> None:
        """Done (eos/length/stop/abort): its full pages go to the prefix cache, the rest are freed.
        A parked request keeps its pages until its source is done (a write may still land in them)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._probed.discard(req.rid)
        job = self.parked.get(req.rid)
        if job is not None:
            job.abort()
        else:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def find(self, rid: str) -> Req | None:
        job = self.parked.get(rid)
        if job is not None:
            return None if job.aborted else job.req
        return next((r for r in (*self.running, *self.waiting) if r.rid == rid), None)

    @property
    def has_work(self) -> bool:
        """Anything to schedule: queued, running, or parked (whose progress schedule() checks)."""
        return bool(self.waiting or self.running or self.parked)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.parked)

    def owner_lists(self) -> list[list[int]]:
        """Every page list a request or a parked job holds a reference on (the pool integrity check)."""
        owners = [r.pages for r in self.running]
        for job in self.parked.values():
            owners.append(job.req.pages)
            owners += job.held_pages()
        return owners

    # -- the step -----------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.cfg.token_budget
        if self.tiers is not None:
            self.tiers.poll()
        if self.parked:
            self._advance_parked(batch)
        self.running.sort(key=self._rank)  # stable: FCFS among equals; the worst last (the victim)
        if self.waiting and self.running:
            self._preempt_for(self._next_waiting(), batch)
        for req in list(self.running):
            if req not in self.running:  # preempted earlier in this loop to make room
                continue
            n = self._chunk(req, budget)
            if n == 0:
                continue
            if req.draft_ids and not req.is_prefilling:
                n += self._fit_drafts(req, budget)
            if not self._make_room(req, n, batch):
                continue
            budget -= n
            if req.is_prefilling:
                batch.prefill.append((req, n))
            else:
                batch.decode.append(req)
        while self.waiting and budget > 0 and self.num_active < self.cfg.max_batch:
            req = self._next_waiting()
            from_peer = self._kv_from_peer(req)  # then every prompt page is reserved up front
            admitted = self._admit(req, req.num_prompt, whole=True) if from_peer else self._admit(req, budget)
            if admitted is None:  # parked on a lower tier
                self._take(req)
                continue
            if not admitted:
                break
            self._take(req)
            req.status = Status.RUNNING
            job = self.peer(req) if from_peer else None
            if job is not None:
                self.parked[req.rid] = job
                continue
            self.running.append(req)  # prefilled here (a peer's request too, when the peer says so)
            n = self._chunk(req, budget)
            budget -= n
            batch.prefill.append((req, n))
        return batch

    # -- priorities -------------------------------------------------------------------------------------

    def _rank(self, req: Req) -> tuple[int, int]:
        """Lower is served first: its priority, or above every priority once passed max_overtakes times."""
        return (0, 0) if req.overtaken >= self.cfg.max_overtakes else (1, req.priority)

    def _next_waiting(self) -> Req:
        """The best-ranked waiting request; among equals the first in the queue (min keeps the first)."""
        return min(self.waiting, key=self._rank)

    def _take(self, req: Req) -> None:
        """Out of the queue; every request ahead of it ranks worse and was passed once more."""
        if self.waiting[0] is req:
            self.waiting.popleft()
            return
        for other in self.waiting:
            if other is req:
                break
            other.overtaken += 1
        self.waiting.remove(req)

    def _preempt_for(self, req: Req, batch: Batch) -> None:
        """A waiting request that ranks above the worst running ones takes their place when the batch is
        full or the pages its first chunk needs are not there (they go to the cache and L2, not lost)."""
        need = -(-min(req.num_uncomputed, self.cfg.chunk_size) // self.cfg.page_size)
        while self.running and self._rank(req) < self._rank(self.running[-1]) and (
                self.num_active >= self.cfg.max_batch
                or self.pool.num_free + self.radix.num_evictable_pages < need):
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)

    def _chunk(self, req: Req, budget: int) -> int:
        return min(req.num_uncomputed, budget, self.cfg.chunk_size)

    def _fit_drafts(self, req: Req, budget: int) -> int:
        """Speculative decoding: as many of the request's drafted tokens as the token budget and the free pages
        take (never an eviction or a preemption for a guess); the rest are dropped. Returns how many stay."""
        k = min(len(req.draft_ids), budget - 1)
        base = self._pages_needed(req, 1)
        while k and self._pages_needed(req, 1 + k) - base > self.pool.num_free:
            k -= 1
        if k < len(req.draft_ids):
            req.draft_ids = req.draft_ids[:k]
            req.draft_probs = req.draft_probs[:k] if req.draft_probs is not None and k else None
        return k

    def trim(self, req: Req) -> None:
        """After a verification: pages past the ones the next step writes into held only rejected drafts' KV;
        they go back to the pool (never to the prefix cache: num_computed never counted a rejected token)."""
        keep = -(-req.num_tokens // self.cfg.page_size)
        if len(req.pages) > keep:
            extra, req.pages = req.pages[keep:], req.pages[:keep]
            self.pool.unref(extra)

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
            victim = self.running[-1]  # the worst-ranked (running is sorted), never one already batched
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
            m = self.radix.match(req.all_ids[:-1], req.params.cache_salt)
            if m.pages:
                self.radix.lock(m.node)
                self._locks[req.rid] = m.node
                self.pool.ref(m.pages)
                req.pages = list(m.pages)
                req.num_locked_pages = len(m.pages)
            req.num_cached = req.num_computed = m.num_tokens
            if req.usage_open:
                req.cached_from = {"device": m.num_tokens} if m.num_tokens else {}
            if self.tiers is not None and (self._park(load_host(req, self.tiers, self.pool, self._reserve))
                                           or (not whole and self._ask_remote(req))):
                return None
        need = self._pages_needed(req, req.num_uncomputed if whole else self._chunk(req, budget))
        if self._reserve(need):
            req.pages += self.pool.alloc(need)
            return True
        self._release(req)  # give back what the match borrowed; try again next step
        return False

    def _park(self, job: Parked | None) -> bool:
        if job is not None:
            self.parked[job.req.rid] = job
        return job is not None

    def _ask_remote(self, req: Req) -> bool:
        """Ask L3 once per request (a miss is not asked again)."""
        if self.tiers.remote is None or req.rid in self._probed:
            return False
        self._probed.add(req.rid)
        return self._park(ask_remote(req, self.tiers, self.pool, self._reserve))

    def _advance_parked(self, batch: Batch) -> None:
        """Every parked request whose source is done: take what arrived, then back to the queue's front
        (a tier load: ask L3 next, or compute the rest), into the decode batch (a peer's KV and first
        token), back to the queue with nothing (retry), or out with an error."""
        for rid, job in list(self.parked.items()):
            if not job.done():
                continue
            del self.parked[rid]
            req, got = job.req, job.result()
            req.pages += got.pages
            req.num_cached = req.num_computed = req.num_computed + len(got.pages) * self.cfg.page_size
            req.num_loaded += len(got.pages) * self.cfg.page_size
            if got.pages and isinstance(job, TierLoad):
                n = len(got.pages) * self.cfg.page_size
                req.loaded_from[job.tier] = req.loaded_from.get(job.tier, 0) + n
                if req.usage_open:
                    req.cached_from[job.tier] = req.cached_from.get(job.tier, 0) + n
                trace.phase(req, f"{n} tokens loaded from {job.tier}")
            if job.aborted:
                self._release(req)
            elif got.error is not None:
                self._release(req)
                req.status, req.finish_reason = Status.FINISHED, "error"
                batch.failed.append((req, got.error))
            elif got.retry:
                self._release(req)
                req.num_cached = 0
                if req.usage_open:
                    req.cached_from = {}
                req.status = Status.WAITING
                self.waiting.appendleft(req)
            elif got.first is not None:
                req.num_computed = req.num_prompt
                for src, n in got.cached_from.items():
                    req.cached_from[src] = req.cached_from.get(src, 0) + n
                req.received = got.received
                req.status = Status.RUNNING
                self.running.append(req)
                batch.arrived.append((req, got))
            elif isinstance(job, TierLoad) and job.tier == "host" and not self._kv_from_peer(req) \
                    and self._ask_remote(req):
                continue  # parked again, now on L3 for the pages after these
            else:
                req.status = Status.WAITING
                self.waiting.appendleft(req)

    def _kv_from_peer(self, req: Req) -> bool:
        """Disaggregated decode: a new request's prompt KV comes from a prefill server, not from here."""
        return self.peer is not None and req.num_output == 0

    def preempt(self, req: Req) -> None:
        """Release the KV to the cache (the device radix, L2 once evicted: found there at re-admission,
        not recomputed) and requeue first."""
        self.running.remove(req)
        req.draft_ids, req.draft_probs = [], None
        trace.phase(req, f"preempted (KV of {req.num_computed} tokens to the prefix cache)")
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Req) -> None:
        if req.pages and self.cfg.prefix_cache:
            full = req.num_computed // self.cfg.page_size
            if full:
                tokens = req.all_ids[: full * self.cfg.page_size]
                self.radix.insert(tokens, req.pages[:full], req.params.cache_salt)
                if self.tiers is not None:
                    self.tiers.on_release(tokens, req.pages[:full], req.params.cache_salt)
        node = self._locks.pop(req.rid, None)
        if node is not None:
            self.radix.unlock(node)
        if req.pages:
            self.pool.unref(req.pages)
        req.pages = []
        req.num_locked_pages = 0
        req.num_computed = 0
