"""The L3 store's index as pure logic: two-phase puts, leading-page lookups, leases, LRU eviction,
expiry, drops. A hypothesis state machine drives random operation sequences against the invariants."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trnd.store.index import BUSY, COMMITTED, FULL, HAVE, StoreIndex


def H(i: int) -> bytes:
    return hashlib.sha256(b"page %d" % i).digest()


def CS(i: int) -> bytes:
    return hashlib.blake2b(b"bytes %d" % i, digest_size=16).digest()


def put(idx: StoreIndex, ns: str, ids: list[int], now: float = 0.0) -> list[int]:
    rid, slots = idx.reserve(ns, [H(i) for i in ids], now)
    idx.commit(rid, {H(i): CS(i) for i, s in zip(ids, slots) if s >= 0})
    return slots


def test_lookup_counts_leading_committed_pages_only():
    idx = StoreIndex(8, lease_s=5, reserve_s=30)
    put(idx, "a", [0, 1, 3])
    found, lease = idx.lookup("a", [H(0), H(1), H(2), H(3)], 0.0)
    assert [e.key[1] for e in found] == [H(0), H(1)] and lease == 0
    assert [e.checksum for e in found] == [CS(0), CS(1)]
    assert idx.lookup("a", [H(2), H(3)], 0.0)[0] == []
    assert idx.lookup("b", [H(0)], 0.0)[0] == []  # namespaces never mix
    assert idx.stats.hits == 2 and idx.stats.misses == 2 + 2 + 1
    idx.check()


def test_reserved_page_is_never_served_and_a_second_writer_is_told_busy():
    idx = StoreIndex(4, lease_s=5, reserve_s=30)
    rid, slots = idx.reserve("a", [H(0), H(1)], 0.0)
    assert rid and all(s >= 0 for s in slots)
    assert idx.lookup("a", [H(0)], 0.0, lease=True) == ([], 0)
    assert idx.reserve("a", [H(0), H(2)], 0.0)[1][0] == BUSY
    res = idx.commit(rid, {H(0): CS(0), H(1): None})  # H(1)'s bytes did not verify
    assert res == {H(0): True, H(1): False}
    assert [e.key[1] for e in idx.lookup("a", [H(0), H(1)], 0.0)[0]] == [H(0)]
    assert idx.stats.rejected == 1
    assert idx.reserve("a", [H(0)], 0.0)[1] == [HAVE]
    idx.check()


def test_commit_after_expiry_commits_nothing():
    idx = StoreIndex(2, lease_s=5, reserve_s=1)
    rid, _ = idx.reserve("a", [H(0), H(1)], 0.0)
    assert idx.expire(1.0) == (0, 1)
    assert idx.counts()["free"] == 2
    assert idx.commit(rid, {H(0): CS(0)}) == {}
    assert idx.lookup("a", [H(0)], 1.0)[0] == []
    idx.check()


def test_lru_eviction_skips_leased_pages_and_the_requests_own_pages():
    idx = StoreIndex(3, lease_s=5, reserve_s=30)
    put(idx, "a", [0, 1, 2])
    _, lease = idx.lookup("a", [H(0)], 0.0, lease=True)  # 0 pinned, and now most recently used
    assert lease
    slots = put(idx, "a", [3])  # evicts the least recently used unpinned: 1
    assert slots[0] >= 0 and idx.stats.evictions == 1
    assert [len(idx.lookup("a", [H(i)], 0.0)[0]) for i in range(4)] == [1, 0, 1, 1]
    # request [2 (held), 4, 5]: 2 is not evicted for its own successors; 3 goes for 4; 0 is leased, so 5 is FULL
    rid, slots = idx.reserve("a", [H(2), H(4), H(5)], 0.0)
    assert slots[0] == HAVE and slots[1] >= 0 and slots[2] == FULL
    idx.check()
    idx.release(lease)
    idx.abandon(rid)
    assert idx.counts() == {"total": 3, "free": 1, "used": 2, "reserved": 0, "dropped": 0, "pinned": 0}
    idx.check()


def test_full_stops_the_rest_of_the_prefix():
    idx = StoreIndex(2, lease_s=5, reserve_s=30)
    rid, slots = idx.reserve("a", [H(0), H(1), H(2), H(3)], 0.0)
    assert slots[:2] == sorted(slots[:2]) and min(slots[:2]) >= 0 and slots[2:] == [FULL, FULL]
    rid2, slots2 = idx.reserve("a", [H(9)], 0.0)  # everything is reserved: nothing to evict
    assert rid2 == 0 and slots2 == [FULL]
    idx.check()


def test_lease_expiry_and_owner_release():
    idx = StoreIndex(2, lease_s=1, reserve_s=30)
    put(idx, "a", [0, 1])
    _, l1 = idx.lookup("a", [H(0), H(1)], 0.0, lease=True, owner="x")
    _, l2 = idx.lookup("a", [H(0)], 0.5, lease=True, owner="y")
    assert idx.counts()["pinned"] == 2
    assert idx.reserve("a", [H(7)], 0.5)[1] == [FULL]  # all pinned
    assert idx.expire(1.0) == (1, 0)  # l1 ended; l2 (until 1.5) still pins H(0)
    assert l1 not in idx.leases and l2 in idx.leases
    assert idx.reserve("a", [H(7)], 1.0)[1][0] >= 0  # H(1) was evictable
    assert idx.release_owner("y") == (1, 0)
    assert idx.leases == {} and idx.counts()["pinned"] == 0
    idx.check()


def test_drop_of_a_leased_page_frees_its_slot_on_the_last_release():
    idx = StoreIndex(1, lease_s=5, reserve_s=30)
    put(idx, "a", [0])
    _, lease = idx.lookup("a", [H(0)], 0.0, lease=True)
    assert idx.drop("a", H(0))
    assert idx.lookup("a", [H(0)], 0.0)[0] == []
    c = idx.counts()
    assert c["dropped"] == 1 and c["free"] == 0
    assert idx.reserve("a", [H(1)], 0.0)[1] == [FULL]  # the dropped slot is still being read
    idx.check()
    idx.release(lease)
    assert idx.counts()["free"] == 1
    assert idx.reserve("a", [H(1)], 0.0)[1][0] == 0
    idx.check()


def test_duplicate_hash_in_one_request():
    idx = StoreIndex(4, lease_s=5, reserve_s=30)
    rid, slots = idx.reserve("a", [H(0), H(0)], 0.0)
    assert slots[0] >= 0 and slots[1] == BUSY
    idx.check()


# -- state machine ----------------------------------------------------------------------------------

NUM_SLOTS = 4
KEYS = [("a", i) for i in range(6)] + [("b", i) for i in range(3)]
LEASE_S, RESERVE_S = 3.0, 5.0


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.idx = StoreIndex(NUM_SLOTS, LEASE_S, RESERVE_S)
        self.now = 0.0
        self.checksum: dict[tuple[str, int], bytes] = {}  # committed checksum per key (model)
        self.leases: dict[int, tuple[float, list[tuple[tuple, int]]]] = {}  # id -> (expires, [(key, slot)])
        self.res: dict[int, tuple[float, list[tuple[tuple, int]]]] = {}  # id -> (expires, [(key, slot)])

    def _live_leases(self):
        return {lid: v for lid, v in self.leases.items() if v[0] > self.now}

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def reserve(self, keys):
        ns = keys[0][0]
        keys = [k for k in keys if k[0] == ns]
        busy = {slot for _, entries in self.res.values() for _, slot in entries}
        pinned = {slot for _, entries in self._live_leases().values() for _, slot in entries}
        free_before = self.idx.counts()["free"]
        ev0 = self.idx.stats.evictions
        rid, slots = self.idx.reserve(ns, [H(i) for _, i in keys], self.now)
        got = [(k, s) for k, s in zip(keys, slots) if s >= 0]
        for k, s in got:
            assert s not in busy, "a reserved slot was handed out again"
            assert s not in pinned, "a leased slot was overwritten"
            self.checksum.pop(k, None)
        if len(got) <= free_before:
            assert self.idx.stats.evictions == ev0, "evicted while free slots remained"
        if FULL in slots:  # nothing is reserved after the first page that found no room
            assert all(s < 0 for s in slots[slots.index(FULL):])
        assert (rid != 0) == bool(got)
        if rid:
            self.res[rid] = (self.now + RESERVE_S, got)
        # evicted keys leave the model
        for k in list(self.checksum):
            e = self.idx.keys.get((k[0], H(k[1])))
            if e is None or e.state != COMMITTED:
                self.checksum.pop(k)

    @precondition(lambda self: self.res)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.res)))
        expires, entries = self.res.pop(rid)
        good = data.draw(st.lists(st.booleans(), min_size=len(entries), max_size=len(entries)))
        verified = {H(k[1]): (CS(k[1]) if g else None) for (k, _), g in zip(entries, good)}
        out = self.idx.commit(rid, verified)
        assert set(out) == {H(k[1]) for k, _ in entries}  # a live reservation: every page answered
        assert rid not in self.idx.reservations
        for (k, _), g in zip(entries, good):
            if out.get(H(k[1])):
                assert g
                self.checksum[k] = CS(k[1])

    @precondition(lambda self: self.res)
    @rule(data=st.data())
    def abandon(self, data):
        rid = data.draw(st.sampled_from(sorted(self.res)))
        self.res.pop(rid)
        self.idx.abandon(rid)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5), lease=st.booleans())
    def lookup(self, keys, lease):
        ns = keys[0][0]
        keys = [k for k in keys if k[0] == ns]
        found, lid = self.idx.lookup(ns, [H(i) for _, i in keys], self.now, lease=lease)
        # exactly the leading committed keys of the model
        n = 0
        while n < len(keys) and keys[n] in self.checksum:
            n += 1
        assert len(found) == n, f"lookup found {len(found)}, model says {n} leading committed"
        for k, e in zip(keys, found):
            assert e.state == COMMITTED and e.checksum == self.checksum[k]
        if lid:
            self.leases[lid] = (self.now + LEASE_S, [(k, e.slot) for k, e in zip(keys, found)])

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        self.leases.pop(lid)
        self.idx.release(lid)

    @rule(key=st.sampled_from(KEYS))
    def drop(self, key):
        dropped = self.idx.drop(key[0], H(key[1]))
        assert dropped == (key in self.checksum)
        self.checksum.pop(key, None)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 6.0]))
    def tick(self, dt):
        self.now += dt
        self.idx.expire(self.now)
        self.leases = self._live_leases()
        self.res = {rid: v for rid, v in self.res.items() if v[0] > self.now}
        for k in list(self.checksum):  # expiry never removes committed pages
            assert (k[0], H(k[1])) in self.idx.keys

    @invariant()
    def consistent(self):
        self.idx.check()
        assert set(self.idx.leases) == set(self.leases)
        c = self.idx.counts()
        assert c["free"] + c["used"] + c["reserved"] + c["dropped"] == NUM_SLOTS
        assert c["used"] == len(self.checksum)

    @invariant()
    def leased_pages_stay(self):
        """While a lease lives, its pages stay committed at their slot (or were dropped as corrupt)."""
        for _, entries in self._live_leases().values():
            for k, slot in entries:
                e = self.idx.slots[slot]
                assert e is not None and e.key == (k[0], H(k[1])), "a leased slot was reused"


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_tiny(n):
    idx = StoreIndex(n, lease_s=1, reserve_s=1)
    rid, slots = idx.reserve("a", [H(0)], 0.0)
    assert (rid != 0) == (n == 1) and (slots == [FULL]) == (n == 0)
    idx.check()
