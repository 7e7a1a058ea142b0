"""The prefix cache across tiers: device pages (RadixCache), host DRAM (L2), a remote store (L3).

Wraps the radix cache rather than adding fields to its nodes: the radix cache's eviction hook hands
pages down (write-back), a finished request's pages can go down at once (write-through, and to the
remote store for the next turn of a session), and admission asks the lower tiers for the pages that
follow a device hit. Every tier names a page by the same chained hash (cache/hashing.py).

Host loads and write-through saves run on the host tier's copy threads, remote operations on the store
client's thread: all are futures, and the device pages they touch stay owned here (pool references)
or by the loading request until they resolve, so a page is never reused under a copy.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

from trnd.cache.hashing import page_hashes
from trnd.cache.host import HostTier
from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache

POLICIES = ("write-back", "write-through")


class Tiers:
    def __init__(self, radix: RadixCache, pool: PagePool, page_size: int, namespace: str,
                 host: HostTier | None = None, policy: str = "write-back", remote=None,
                 remote_on_finish: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"host_policy = {policy!r} is not one of {', '.join(POLICIES)}")
        self.radix, self.pool, self.page_size, self.namespace = radix, pool, page_size, namespace
        self.host, self.policy = host, policy
        self.remote, self.remote_on_finish = remote, remote_on_finish
        # (future, device pages held until it resolves, tier)
        self._writes: list[tuple[concurrent.futures.Future, list[int], str]] = []
        self._fenced: list[int] = []  # pages a timed-out remote read may still write into
        self.remote_written = 0
        if host is not None and policy == "write-back":
            radix.on_evict = self._evicted

    def hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        return page_hashes(token_ids, self.page_size, self.namespace, salt=salt)

    def _evicted(self, hashes: list[bytes], pages: list[int]) -> None:
        self.host.put(hashes, pages)

    def on_release(self, token_ids: Sequence[int], pages: list[int], salt: str | None = None) -> None:
        """A request's full pages went into the device cache (finish, abort or preemption)."""
        if self.host is None and self.remote is None:
            return
        hashes = self.hashes(token_ids, salt)
        if self.host is not None and self.policy == "write-through":
            self.pool.ref(pages)
            self._writes.append((self.host.put_async(hashes, list(pages)), list(pages), "host"))
        if self.remote is not None and self.remote_on_finish and pages:
            self.pool.ref(pages)
            self._writes.append((self.remote.write(hashes, list(pages)), list(pages), "remote"))

    # -- loads --------------------------------------------------------------------------------------

    def host_probe(self, hashes: list[bytes]) -> int:
        return self.host.probe(hashes) if self.host is not None else 0

    def host_load(self, hashes: list[bytes], pages: list[int]) -> concurrent.futures.Future:
        """Starts the copy on the load thread; the future gives how many leading pages arrived."""
        return self.host.load(hashes, pages)

    def remote_lookup(self, hashes: list[bytes]) -> concurrent.futures.Future:
        return self.remote.lookup(hashes)

    def remote_read(self, hashes: list[bytes], pages: list[int]) -> concurrent.futures.Future:
        return self.remote.read(hashes, pages)

    def settle_read(self, pages: list[int], loaded: int) -> None:
        """After a remote read resolved: release the pages past `loaded`, later if a transfer that
        outlived its deadline may still write into them."""
        rest = pages[loaded:]
        fenced = self.remote.fenced() if rest else set()
        self._fenced += [p for p in rest if p in fenced]
        free = [p for p in rest if p not in fenced]
        if free:
            self.pool.unref(free)

    # -- housekeeping (engine thread, every step) ---------------------------------------------------

    def poll(self) -> None:
        if self._writes:
            keep = []
            for fut, pages, tier in self._writes:
                if fut.done():
                    if tier == "remote":
                        self.remote_written += fut.result() if not fut.exception() else 0
                    self.pool.unref(pages)
                else:
                    keep.append((fut, pages, tier))
            self._writes = keep
        if self._fenced:
            still = self.remote.fenced()
            done = [p for p in self._fenced if p not in still]
            self._fenced = [p for p in self._fenced if p in still]
            if done:
                self.pool.unref(done)

    @property
    def busy(self) -> bool:
        return bool(self._writes or self._fenced)

    def held_pages(self) -> list[list[int]]:
        return [pages for _, pages, _ in self._writes] + [self._fenced]

    def reset(self) -> int:
        return self.host.reset() if self.host is not None else 0

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        if self.remote is not None:
            self.remote.close()

    def stats(self) -> dict:
        return {"policy": self.policy, "host": self.host.stats() if self.host is not None else None,
                "remote": ({**self.remote.state(), "writes_in_flight": sum(t == "remote" for *_, t in self._writes),
                            "pages_written": self.remote_written} if self.remote is not None else None)}
