"""The prefix cache across tiers: device pages (RadixCache), host DRAM (L2), a remote store (L3).

Wraps the radix cache rather than adding fields to its nodes: the radix cache's eviction hook hands
pages down (write-back), a finished request's pages can go down at once (write-through, and to the
remote store for the next turn of a session), and admission asks the lower tiers for the pages that
follow a device hit. Every tier names a page by the same chained hash (cache/hashing.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from trnd.cache.hashing import page_hashes
from trnd.cache.host import HostTier
from trnd.cache.radix import RadixCache

POLICIES = ("write-back", "write-through")


class Tiers:
    def __init__(self, radix: RadixCache, page_size: int, namespace: str, host: HostTier | None = None,
                 policy: str = "write-back"):
        if policy not in POLICIES:
            raise ValueError(f"host_policy = {policy!r} is not one of {', '.join(POLICIES)}")
        self.radix, self.page_size, self.namespace = radix, page_size, namespace
        self.host, self.policy = host, policy
        if host is not None and policy == "write-back":
            radix.on_evict = self._evicted

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return page_hashes(token_ids, self.page_size, self.namespace)

    def _evicted(self, hashes: list[bytes], pages: list[int]) -> None:
        self.host.put(hashes, pages)

    def on_release(self, token_ids: Sequence[int], pages: list[int]) -> None:
        """A request's full pages went into the device cache (finish, abort or preemption)."""
        if self.host is not None and self.policy == "write-through":
            self.host.put(self.hashes(token_ids), pages)

    def host_probe(self, hashes: list[bytes]) -> int:
        return self.host.probe(hashes) if self.host is not None else 0

    def host_load(self, hashes: list[bytes], pages: list[int]) -> int:
        return self.host.load(hashes, pages) if self.host is not None else 0

    def reset(self) -> int:
        return self.host.reset() if self.host is not None else 0

    def stats(self) -> dict:
        return {"policy": self.policy, "host": self.host.stats() if self.host is not None else None}
