"""The L3 store's index: which slot holds which page, and who may touch it.

A slot is one canonical page of the store's DRAM region. It is free, or holds an entry keyed by
(namespace, page hash) that is
    reserved   a writer was handed the slot and is writing into it: never served by lookup;
    committed  its bytes were verified against the writer's checksum: served by lookup;
    dropped    removed from the key space (corrupt) while leases still pin it: freed on the last release.
Committed entries sit in an LRU; when a reservation finds no free slot, the least recently used
committed entry that no lease pins is evicted. Leases (taken by a lookup for a read) and reservations
expire, so a client that dies or stalls can neither pin memory nor hold slots for long.

Pure logic: no I/O, no clock of its own (every call that cares takes `now`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

RESERVED, COMMITTED, DROPPED = "reserved", "committed", "dropped"

# What `reserve` answers for a hash instead of a slot.
HAVE = -1  # already committed: nothing to write
BUSY = -2  # another writer holds a reservation for it
FULL = -3  # no free or evictable slot (and none for the pages after it either)

Key = tuple[str, bytes]


@dataclass(eq=False)
class Entry:
    slot: int
    key: Key
    state: str
    checksum: bytes = b""
    pins: int = 0  # leases holding this entry


@dataclass(eq=False)
class Lease:
    id: int
    expires: float
    entries: list[Entry]
    owner: Hashable = None


@dataclass(eq=False)
class Reservation:
    id: int
    expires: float
    entries: list[Entry]  # in the order of the Reserve request, reserved ones only
    owner: Hashable = None


@dataclass
class IndexStats:
    hits: int = 0  # pages returned by lookups
    misses: int = 0  # pages asked for and not returned (at and after the first absent one)
    reserved: int = 0
    committed: int = 0
    rejected: int = 0  # reserved pages whose bytes did not match the writer's checksum
    evictions: int = 0
    dropped: int = 0  # committed pages removed as corrupt
    leases: int = 0  # leases granted
    lease_expiries: int = 0
    reservation_expiries: int = 0


class StoreIndex:
    def __init__(self, num_slots: int, lease_s: float, reserve_s: float):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots, self.lease_s, self.reserve_s = num_slots, lease_s, reserve_s
        self.slots: list[Entry | None] = [None] * num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest slot first
        self.keys: dict[Key, Entry] = {}  # reserved and committed entries
        self.lru: OrderedDict[Key, Entry] = OrderedDict()  # committed entries, least recently used first
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        self.stats = IndexStats()

    # -- reads --------------------------------------------------------------------------------------

    def lookup(self, ns: str, hashes: Sequence[bytes], now: float, lease: bool = False,
               owner: Hashable = None) -> tuple[list[Entry], int]:
        """The committed entries of the LEADING hashes (stops at the first that is not committed),
        and a lease id pinning them (0 when not asked for or nothing was found)."""
        found: list[Entry] = []
        for h in hashes:
            e = self.keys.get((ns, h))
            if e is None or e.state != COMMITTED:
                break
            found.append(e)
        for e in found:
            self.lru.move_to_end(e.key)
        self.stats.hits += len(found)
        self.stats.misses += len(hashes) - len(found)
        if not lease or not found:
            return found, 0
        lid = next(self._ids)
        for e in found:
            e.pins += 1
        self.leases[lid] = Lease(lid, now + self.lease_s, found, owner)
        self.stats.leases += 1
        return found, lid

    def release(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        for e in lease.entries:
            e.pins -= 1
            if e.pins == 0 and e.state == DROPPED:
                self._free_slot(e)
        return True

    # -- writes -------------------------------------------------------------------------------------

    def reserve(self, ns: str, hashes: Sequence[bytes], now: float, owner: Hashable = None) -> tuple[int, list[int]]:
        """A slot per hash (or HAVE / BUSY / FULL), and the reservation id (0 when nothing was
        reserved). Hashes are taken in prefix order: once no slot can be had, the rest are FULL, since a
        page is useless to a reader without the pages before it."""
        out: list[int] = []
        entries: list[Entry] = []
        keep = set()  # committed entries of this request: not evicted to make room for its others
        for h in hashes:
            e = self.keys.get((ns, h))
            if e is not None and e.state == COMMITTED:
                keep.add(e.key)
                self.lru.move_to_end(e.key)
        seen = set()
        full = False
        for h in hashes:
            key = (ns, h)
            e = self.keys.get(key)
            if e is not None:
                out.append(HAVE if e.state == COMMITTED else BUSY)
                continue
            if key in seen:  # the same page twice in one request: the first reservation covers it
                out.append(BUSY)
                continue
            slot = None if full else self._take_slot(keep)
            if slot is None:
                full = True
                out.append(FULL)
                continue
            e = Entry(slot, key, RESERVED)
            self.slots[slot] = e
            self.keys[key] = e
            entries.append(e)
            seen.add(key)
            out.append(slot)
        if not entries:
            return 0, out
        rid = next(self._ids)
        self.reservations[rid] = Reservation(rid, now + self.reserve_s, entries, owner)
        self.stats.reserved += len(entries)
        return rid, out

    def reserved_slot(self, rid: int, ns: str, h: bytes) -> int | None:
        """The slot reservation `rid` holds for (ns, h), if it still does."""
        r = self.reservations.get(rid)
        e = self.keys.get((ns, h))
        if r is None or e is None or e.state != RESERVED or not any(x is e for x in r.entries):
            return None
        return e.slot

    def commit(self, rid: int, verified: Mapping[bytes, bytes | None]) -> dict[bytes, bool]:
        """Close reservation `rid`: each hash whose checksum the caller verified against the slot's
        bytes (hash -> checksum) is committed; a hash mapped to None (bytes did not match) and every
        reserved hash not mentioned are freed. Returns hash -> committed for the reservation's hashes
        (empty if the reservation is unknown or expired: nothing is committed then)."""
        r = self.reservations.pop(rid, None)
        if r is None:
            return {}
        out = {}
        for e in r.entries:
            h = e.key[1]
            cs = verified.get(h)
            if cs is not None:
                e.state, e.checksum = COMMITTED, cs
                self.lru[e.key] = e
                self.stats.committed += 1
                out[h] = True
            else:
                if h in verified:
                    self.stats.rejected += 1
                self._remove(e)
                out[h] = False
        return out

    def abandon(self, rid: int) -> bool:
        """The writer gives up: its reserved slots are free again."""
        r = self.reservations.pop(rid, None)
        if r is None:
            return False
        for e in r.entries:
            self._remove(e)
        return True

    def drop(self, ns: str, h: bytes) -> bool:
        """Remove a committed page (its bytes were found corrupt). A slot still pinned by a lease is
        freed when the last lease on it ends."""
        e = self.keys.get((ns, h))
        if e is None or e.state != COMMITTED:
            return False
        self.stats.dropped += 1
        del self.lru[e.key]
        del self.keys[e.key]
        if e.pins:
            e.state = DROPPED
        else:
            self._free_slot(e)
        return True

    # -- time and owners ----------------------------------------------------------------------------

    def expire(self, now: float) -> tuple[int, int]:
        """End leases and reservations past their time. Returns (leases, reservations) ended."""
        leases = [lid for lid, x in self.leases.items() if x.expires <= now]
        for lid in leases:
            self.release(lid)
        res = [rid for rid, x in self.reservations.items() if x.expires <= now]
        for rid in res:
            self.abandon(rid)
        self.stats.lease_expiries += len(leases)
        self.stats.reservation_expiries += len(res)
        return len(leases), len(res)

    def release_owner(self, owner: Hashable) -> tuple[int, int]:
        """A client went away: its leases and reservations end now."""
        leases = [lid for lid, x in self.leases.items() if x.owner == owner]
        for lid in leases:
            self.release(lid)
        res = [rid for rid, x in self.reservations.items() if x.owner == owner]
        for rid in res:
            self.abandon(rid)
        return len(leases), len(res)

    # -- inspection ---------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        n = {RESERVED: 0, COMMITTED: 0, DROPPED: 0}
        for e in self.slots:
            if e is not None:
                n[e.state] += 1
        return {"total": self.num_slots, "free": len(self.free), "used": n[COMMITTED], "reserved": n[RESERVED],
                "dropped": n[DROPPED], "pinned": sum(1 for e in self.lru.values() if e.pins)}

    def namespaces(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for ns, _ in self.lru:
            out[ns] = out.get(ns, 0) + 1
        return out

    def find(self, h: bytes) -> Entry | None:
        """The committed entry of hash h in any namespace (debug hooks)."""
        for (_, kh), e in self.lru.items():
            if kh == h:
                return e
        return None

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests)."""
        free = set(self.free)
        assert len(free) == len(self.free), "a slot is on the free list twice"
        pins: dict[int, int] = {}
        for lease in self.leases.values():
            for e in lease.entries:
                pins[id(e)] = pins.get(id(e), 0) + 1
        in_res = {id(e) for r in self.reservations.values() for e in r.entries}
        for slot, e in enumerate(self.slots):
            if e is None:
                assert slot in free, f"slot {slot} is neither free nor held"
                continue
            assert slot not in free, f"slot {slot} is free and held by {e.key}"
            assert e.slot == slot
            assert e.pins == pins.get(id(e), 0), f"slot {slot}: {e.pins} pins, {pins.get(id(e), 0)} leases"
            if e.state == RESERVED:
                assert self.keys.get(e.key) is e and e.key not in self.lru and id(e) in in_res
                assert e.pins == 0, "a reserved slot is leased"
            elif e.state == COMMITTED:
                assert self.keys.get(e.key) is e and self.lru.get(e.key) is e and id(e) not in in_res
            else:
                assert e.state == DROPPED and e.pins > 0 and self.keys.get(e.key) is not e
        assert len(self.keys) == sum(1 for e in self.slots if e is not None and e.state != DROPPED)

    # -- internals ----------------------------------------------------------------------------------

    def _take_slot(self, keep: set) -> int | None:
        if self.free:
            return self.free.pop()
        for key, e in self.lru.items():
            if e.pins == 0 and key not in keep:
                del self.lru[key]
                del self.keys[key]
                self.slots[e.slot] = None
                self.stats.evictions += 1
                return e.slot
        return None

    def _remove(self, e: Entry) -> None:
        if self.keys.get(e.key) is e:
            del self.keys[e.key]
        if self.lru.get(e.key) is e:
            del self.lru[e.key]
        self._free_slot(e)

    def _free_slot(self, e: Entry) -> None:
        if self.slots[e.slot] is e:
            self.slots[e.slot] = None
            self.free.append(e.slot)
