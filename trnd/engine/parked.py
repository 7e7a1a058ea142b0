"""Requests whose KV comes from elsewhere: one contract for every source.

The scheduler parks a request here instead of computing its prefix: a host-tier (L2) copy, a
remote-store (L3) lookup then read, or (decode role) a prefill peer writing the prompt's KV. The batch
keeps stepping meanwhile. Each step the scheduler asks every parked request `done()`; once it is, it
takes `result()` (the pages that now hold KV, a first token, or "retry" / an error) and the request
goes back to the queue's front, joins the decode batch, or fails. `abort()` never frees pages itself:
a write may still land in them, so the request stays parked until its source says `done()`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field

from trnd.engine.request import Req


@dataclass
class Landing:
    """What a parked request's source brought, read once it is done()."""
    pages: list[int] = field(default_factory=list)  # pages now holding the KV after req.pages (a tier load)
    first: object = None  # SampleOut: the first token, sampled by a prefill peer (the prompt's KV is all in)
    computed_tokens: int = 0  # prompt tokens a peer computed (engine stats)
    cached_from: dict[str, int] = field(default_factory=dict)  # a peer's cache hits beyond ours (Req.cached_from)
    received: int = 0  # prompt tokens whose KV a peer wrote here
    retry: bool = False  # back to the queue with nothing cached (another peer, or computed here)
    error: BaseException | None = None  # the request fails with this (503: engine/loop.py Unavailable)


class Parked:
    """One parked request. `phase` is what /admin/state calls it."""
    phase = "loading_kv"

    def __init__(self, req: Req):
        self.req = req
        self.aborted = False

    def done(self) -> bool:
        raise NotImplementedError

    def result(self) -> Landing:
        raise NotImplementedError

    def abort(self) -> None:
        self.aborted = True

    def held_pages(self) -> list[list[int]]:
        """Pages this job holds beyond req.pages (for the pool integrity check)."""
        return []


class TierLoad(Parked):
    """A host (L2) copy on the tier's load thread, or a remote (L3) lookup then a NIXL read."""

    def __init__(self, req: Req, hashes: list[bytes], fut: concurrent.futures.Future, tiers, pool,
                 reserve: Callable[[int], bool], pages: list[int] | None = None, tier: str = "remote"):
        super().__init__(req)
        self.hashes, self.fut, self.tiers, self.pool, self.reserve = hashes, fut, tiers, pool, reserve
        self.pages = pages or []  # allocated for the copy, owned here until it resolves
        self.tier = tier

    def _found(self) -> int:
        return self.fut.result() if self.fut.exception() is None else 0

    def done(self) -> bool:
        if not self.fut.done():
            return False
        if self.tier == "remote" and not self.pages and not self.aborted:
            n = self._found()  # the lookup's answer: this many leading pages are there; read them
            if n > 0 and self.reserve(n):
                self.pages = self.pool.alloc(n)
                self.fut = self.tiers.remote_read(self.hashes[:n], self.pages)
                return False
        return True

    def result(self) -> Landing:
        """Whatever arrived counts (a miss, a dead or slow store: simply less cached)."""
        loaded = 0 if self.aborted or not self.pages else self._found()
        if self.tier == "host":
            self.pool.unref(self.pages[loaded:])
        elif self.pages:
            self.tiers.settle_read(self.pages, loaded)
        return Landing(pages=self.pages[:loaded])

    def held_pages(self) -> list[list[int]]:
        return [self.pages]


def load_host(req: Req, tiers, pool, reserve: Callable[[int], bool]) -> TierLoad | None:
    """Park the request while the host tier copies the pages after its device hit (instead of
    recomputing them)."""
    hashes = tiers.hashes(req.all_ids[:-1], req.params.cache_salt)[len(req.pages):]
    k = tiers.host_probe(hashes)
    if not k or not reserve(k):
        return None
    pages = pool.alloc(k)
    return TierLoad(req, hashes, tiers.host_load(hashes[:k], pages), tiers, pool, reserve, pages, tier="host")


def ask_remote(req: Req, tiers, pool, reserve: Callable[[int], bool]) -> TierLoad | None:
    """Park the request while L3 is asked for the full pages after its local hits."""
    if tiers.remote is None:
        return None
    hashes = tiers.hashes(req.all_ids[:-1], req.params.cache_salt)[len(req.pages):]
    if not hashes:
        return None
    return TierLoad(req, hashes, tiers.remote_lookup(hashes), tiers, pool, reserve)
