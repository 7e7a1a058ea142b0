"""Which target serves a request: fit, then session, then prefix, then load. Plain functions of the
targets' state; no I/O, unit tested (tests/unit/test_router_policy.py).

1. Fit: only targets whose context (their decode point) holds prompt + max_tokens, and of those the
   smallest context that fits (a 1m point is not spent on a short chat).
2. Session (`session_id` in the body, or `x-session-id`): rendezvous hashing over the healthy fitting
   targets, so adding or losing one target moves only the sessions that hashed to it.
3. Prefix: the target that was sent the longest prefix of this prompt (the router remembers the chained
   hashes of the prompt blocks it routed), unless it carries more than `slack` requests over the least
   loaded one.
4. Load: the fewest requests in flight.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from trnd.router.targets import Target


class NoTarget(Exception):
    """No healthy target at all (503), or none whose context fits (400, with the numbers)."""

    def __init__(self, message: str, fits: bool):
        super().__init__(message)
        self.fits = fits


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def rendezvous(key: str, targets: list[Target]) -> Target:
    """Highest random weight: each (key, target) pair gets a hash; the largest wins."""
    return max(targets, key=lambda t: _h(f"{key}|{t.addr}".encode()))


def prefix_hashes(text: str, block: int, salt: str | None = None) -> list[int]:
    """Chained hashes of the text's whole blocks: equal lists mean equal prefixes (of one cache salt:
    http/tenant.py; two tenants' routes never meet)."""
    out, h = [], (salt or "").encode()
    data = text.encode("utf-8", errors="replace")
    for i in range(0, len(data) - block + 1, block):
        h = hashlib.blake2b(h + data[i:i + block], digest_size=8).digest()
        out.append(int.from_bytes(h, "big"))
    return out


# Measured with tracemalloc (tests/test_router_policy.py): an OrderedDict entry of a 32-character str key and
# a shared target address, and of an int key. What the maps' byte gauges in /metrics count per entry.
SESSION_ENTRY_BYTES = 172
PREFIX_ENTRY_BYTES = 141


class Sessions:
    """session key -> the target it was last routed to, least recently used dropped first (`max_sessions`):
    what /admin/state counts per target. Routing itself needs no table (rendezvous hashing)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.map: OrderedDict[str, str] = OrderedDict()

    def record(self, key: str, addr: str) -> None:
        self.map[key] = addr
        self.map.move_to_end(key)
        while len(self.map) > self.capacity:
            self.map.popitem(last=False)

    def per_target(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for addr in self.map.values():
            out[addr] = out.get(addr, 0) + 1
        return out

    @property
    def nbytes(self) -> int:
        return len(self.map) * SESSION_ENTRY_BYTES


class PrefixIndex:
    """block hash -> the target last sent a prompt with that prefix; least recently used dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.map: OrderedDict[int, str] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return len(self.map) * PREFIX_ENTRY_BYTES

    def longest(self, hashes: list[int], addrs: set[str]) -> tuple[str | None, int]:
        """The target holding the longest prefix among `addrs`, and how many blocks it holds."""
        best, n = None, 0
        for i, h in enumerate(hashes):
            addr = self.map.get(h)
            if addr is None:
                break
            if addr in addrs:
                best, n = addr, i + 1
        return best, n

    def record(self, hashes: list[int], addr: str) -> None:
        for h in hashes:
            self.map[h] = addr
            self.map.move_to_end(h)
        while len(self.map) > self.capacity:
            self.map.popitem(last=False)

    def forget(self, addr: str) -> None:
        for h in [h for h, a in self.map.items() if a == addr]:
            del self.map[h]


def fitting(targets: list[Target], need: int) -> list[Target]:
    """The healthy targets of the smallest context that holds `need` tokens."""
    fit = [t for t in targets if t.max_model_len and t.max_model_len >= need]
    if not fit:
        return []
    smallest = min(t.max_model_len for t in fit)
    return [t for t in fit if t.max_model_len == smallest]


def choose(healthy: list[Target], need: int, session: str | None, hashes: list[int], index: PrefixIndex,
           slack: int, exclude: set[str] = frozenset(), spray: int | None = None) -> tuple[Target, str]:
    """(target, rule) with rule one of "session", "prefix", "load"; or "random" when `spray` (the
    request's sequence number) is given: a target hashed from it, ignoring sessions and prefixes, the
    session-unaware baseline the benchmark measures affinity against (plain round-robin would keep a
    session on one target whenever the sessions per round divide evenly). Raises NoTarget."""
    live = [t for t in healthy if t.addr not in exclude]
    if not live:
        raise NoTarget("no healthy decode server" + (" left to retry on" if exclude else ""), fits=True)
    pool = fitting(live, need)
    if not pool:
        biggest = max(t.max_model_len or 0 for t in live)
        raise NoTarget(f"this request needs {need} tokens of context (prompt + max_tokens), but the largest "
                       f"context served is {biggest}", fits=False)
    if spray is not None:
        return rendezvous(f"request-{spray}", pool), "random"
    if session:
        return rendezvous(session, pool), "session"
    least = min(pool, key=lambda t: (t.in_flight, t.requests))
    addr, n = index.longest(hashes, {t.addr for t in pool})
    if addr is not None and n > 0:
        holder = next(t for t in pool if t.addr == addr)
        if holder.in_flight <= least.in_flight + slack:
            return holder, "prefix"
    return least, "load"
