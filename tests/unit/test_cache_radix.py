import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trnd.cache.hashing import page_hashes
from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache, check_pool_integrity


def make(num_pages=32, page_size=2, namespace="m", **kw):
    pool = PagePool(num_pages)
    return pool, RadixCache(pool, page_size, namespace, **kw)


def cache_seq(pool, radix, ids):
    """A request that computed all of ids itself, finished, inserted and let go of its pages."""
    n = len(ids) // radix.page_size
    pages = pool.alloc(n)
    present = radix.insert(ids[:n * radix.page_size], pages)
    pool.unref(pages)
    return present


def test_match_on_empty_tree():
    pool, radix = make()
    m = radix.match([1, 2, 3])
    assert m.node is radix.root and m.pages == [] and m.num_tokens == 0
    assert radix.stats()["query_tokens"] == 3 and radix.stats()["hit_tokens"] == 0


def test_insert_then_match_whole_pages_only():
    pool, radix = make(page_size=2)
    pages = pool.alloc(3)
    assert radix.insert([1, 2, 3, 4, 5, 6], pages) == 0
    assert [pool.refcount(p) for p in pages] == [2, 2, 2]
    pool.unref(pages)
    radix.check_integrity()
    assert radix.match([1, 2, 3, 4, 5, 6, 7]).pages == pages  # trailing partial page ignored
    assert radix.match([1, 2, 3, 4, 5]).pages == pages[:2]  # page 3 is not whole in the query
    assert radix.match([1, 2, 3, 9, 5, 6]).pages == pages[:1]  # mismatch inside page 2
    assert radix.match([1, 9]).pages == []
    m = radix.match([1, 2, 3, 4, 5, 6])
    assert m.num_tokens == 6 and m.pages == pages


def test_insert_splits_at_page_boundary_and_dedups():
    pool, radix = make(page_size=2)
    a = pool.alloc(3)
    radix.insert([1, 2, 3, 4, 5, 6], a)
    b = pool.alloc(3)
    # shares the first two pages; the caller's duplicates are not taken
    assert radix.insert([1, 2, 3, 4, 7, 8], b) == 2
    assert [pool.refcount(p) for p in b] == [1, 1, 2]
    assert radix.num_cached_pages == 4 and radix.num_nodes == 3
    (head,) = radix.root.children.values()
    assert head.pages == a[:2] and sorted(len(c.pages) for c in head.children.values()) == [1, 1]
    pool.unref(a + b)
    radix.check_integrity()
    assert radix.match([1, 2, 3, 4, 7, 8]).pages == a[:2] + b[2:]
    # fully present: nothing new
    c = pool.alloc(2)
    assert radix.insert([1, 2, 3, 4], c) == 2
    assert [pool.refcount(p) for p in c] == [1, 1]
    # diverging in the middle of a page splits before that page
    d = pool.alloc(2)
    assert radix.insert([1, 2, 3, 9], d) == 1
    assert pool.refcount(d[1]) == 2 and pool.refcount(d[0]) == 1
    pool.unref(c + d)
    radix.check_integrity()


def test_insert_requires_whole_pages():
    pool, radix = make(page_size=4)
    with pytest.raises(AssertionError):
        radix.insert([1, 2, 3], pool.alloc(1))


def test_match_splits_node_and_lock_protects_only_matched_part():
    pool, radix = make(page_size=2)
    a = pool.alloc(3)
    radix.insert([1, 2, 3, 4, 5, 6], a)
    pool.unref(a)
    m = radix.match([1, 2, 3, 4, 9, 9])
    assert m.pages == a[:2] and m.node.pages == a[:2] and radix.num_nodes == 2
    radix.lock(m.node)
    pool.ref(m.pages)
    assert radix.num_protected_pages == 2 and radix.num_evictable_pages == 1
    radix.check_integrity()
    assert radix.reset() == 1  # only the unmatched tail goes
    assert pool.refcount(a[2]) == 0
    assert radix.match([1, 2, 3, 4]).pages == a[:2]
    radix.unlock(m.node)
    pool.unref(m.pages)
    assert radix.reset() == 2
    assert pool.num_free == pool.num_pages


def test_lock_prevents_eviction_and_unlock_below_zero_raises():
    pool, radix = make(page_size=1)
    cache_seq(pool, radix, [1, 2, 3])
    m = radix.match([1, 2, 3])
    radix.lock(m.node)
    pool.ref(m.pages)
    assert radix.evict(10) == 0 and radix.num_cached_pages == 3
    radix.unlock(m.node)
    with pytest.raises(ValueError):
        radix.unlock(m.node)
    # still referenced by the request: the tree may let go, but the pages are not freed
    assert radix.evict(10) == 0
    assert radix.num_cached_pages == 0 and radix.evicted_pages == 3
    assert [pool.refcount(p) for p in m.pages] == [1, 1, 1]
    with pytest.raises(ValueError, match="evicted"):
        radix.lock(m.node)
    assert pool.unref(m.pages) == m.pages
    assert pool.num_free == pool.num_pages


def test_split_keeps_locked_node_valid():
    pool, radix = make(page_size=1)
    cache_seq(pool, radix, [1, 2, 3, 4])
    m = radix.match([1, 2, 3, 4])
    radix.lock(m.node)
    pool.ref(m.pages)
    m2 = radix.match([1, 2, 7])  # splits the locked node after 2 pages
    assert m2.pages == m.pages[:2] and m2.node.lock == 1
    radix.check_integrity()
    radix.unlock(m.node)
    pool.unref(m.pages)
    radix.check_integrity()
    assert radix.num_protected_pages == 0
    assert radix.reset() == 4 and pool.num_free == pool.num_pages


def test_lru_order_and_parents_after_children():
    evicted = []
    pool, radix = make(page_size=1, on_evict=lambda hs, ps: evicted.append(list(ps)))
    cache_seq(pool, radix, [1, 10])
    cache_seq(pool, radix, [2, 20])
    cache_seq(pool, radix, [3, 30])
    x = radix.match([1, 10]).pages
    y = radix.match([2, 20]).pages
    z = radix.match([3, 30]).pages
    radix.match([1, 10])  # x is now the most recent, y the oldest
    assert radix.evict(1) == 2  # whole leaf node: [2, 20]
    assert evicted == [y]
    assert radix.evict(3) == 4  # z then x
    assert evicted == [y, z, x]
    assert radix.num_nodes == 0 and pool.num_free == pool.num_pages
    assert radix.evicted_pages == 6


def test_evict_leaves_before_their_parent():
    evicted = []
    pool, radix = make(page_size=1, on_evict=lambda hs, ps: evicted.append(list(ps)))
    cache_seq(pool, radix, [1, 2, 3])
    cache_seq(pool, radix, [1, 2, 4])
    cache_seq(pool, radix, [9])
    leaf3 = radix.match([1, 2, 3]).pages[2:]
    radix.match([9])
    head_and_leaf4 = radix.match([1, 2, 4]).pages
    radix.match([9])
    assert radix.evict(1) == 1 and evicted == [leaf3]
    assert radix.evict(1) == 1 and evicted[-1] == head_and_leaf4[2:]
    assert radix.evict(1) == 2 and evicted[-1] == head_and_leaf4[:2]  # [1, 2] became a leaf
    assert radix.match([9]).num_tokens == 1 and radix.num_cached_pages == 1
    radix.check_integrity()


def test_on_evict_runs_before_unref_with_hashes():
    calls = []
    pool, radix = None, None

    def hook(hashes, pages):
        calls.append((hashes, pages, [pool.refcount(p) for p in pages]))

    pool, radix = make(page_size=2, namespace="ns", on_evict=hook)
    cache_seq(pool, radix, [1, 2, 3, 4])
    pages = radix.match([1, 2, 3, 4]).pages
    radix.reset()
    assert calls == [(page_hashes([1, 2, 3, 4], 2, "ns"), pages, [1, 1])]


def test_hashes_for_chains_and_survives_splits():
    pool, radix = make(page_size=2, namespace="ns")
    cache_seq(pool, radix, [1, 2, 3, 4, 5, 6])
    cache_seq(pool, radix, [1, 2, 7, 8])
    for ids in ([1, 2, 3, 4, 5, 6], [1, 2, 7, 8], [1, 2]):
        node = radix.match(ids).node
        assert radix.hashes_for(node) == page_hashes(ids, 2, "ns")
    assert radix.hashes_for(radix.root) == []
    radix.check_integrity()  # recomputes every node's hashes


def test_namespace_separation():
    _, a = make(namespace="model-a")
    _, b = make(namespace="model-b")
    cache_seq(a.pool, a, [1, 2, 3, 4])
    cache_seq(b.pool, b, [1, 2, 3, 4])
    ha = a.hashes_for(a.match([1, 2, 3, 4]).node)
    hb = b.hashes_for(b.match([1, 2, 3, 4]).node)
    assert len(ha) == 2 and set(ha).isdisjoint(hb)


def test_stats():
    pool, radix = make(page_size=2)
    cache_seq(pool, radix, [1, 2, 3, 4])
    cache_seq(pool, radix, [5, 6])
    m = radix.match([1, 2, 3, 4, 5])  # 4 of 5 tokens hit
    radix.lock(m.node)
    radix.match([7, 8, 9])  # 0 of 3
    s = radix.stats()
    assert s == {"cached_pages": 3, "evictable_pages": 1, "protected_pages": 2, "hit_tokens": 4,
                 "query_tokens": 8, "hit_rate": 0.5, "evicted_pages": 0, "nodes": 2, "salts": 0}
    radix.evict(1)
    assert radix.stats()["evicted_pages"] == 1 and radix.stats()["nodes"] == 1


def test_check_integrity_strict_and_pool_integrity():
    pool, radix = make(num_pages=8, page_size=1)
    req = pool.alloc(3)
    radix.insert([1, 2, 3], req)
    # between insert and the request's unref, unlocked tree pages are shared
    with pytest.raises(AssertionError, match="refcount 2"):
        radix.check_integrity()
    radix.check_integrity(strict=False)
    assert check_pool_integrity(pool, radix, [req]) == {"free": 5, "cached": 0, "in_use": 3, "total": 8}
    with pytest.raises(AssertionError):
        check_pool_integrity(pool, radix, [])  # the request's refs are unaccounted for
    pool.unref(req)
    radix.check_integrity()
    other = pool.alloc(1)
    assert check_pool_integrity(pool, radix, [other]) == {"free": 4, "cached": 3, "in_use": 1, "total": 8}
    pool.unref([req[0]])  # someone drops the tree's ref behind its back
    with pytest.raises(AssertionError):
        radix.check_integrity()
    with pytest.raises(AssertionError):
        check_pool_integrity(pool, radix, [other])


# ---- randomized: simulated requests against the cache ----------------------------------------------

class SimReq:
    def __init__(self, tokens, pages, node, matched):
        self.tokens, self.pages, self.node, self.matched = tokens, pages, node, matched


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class CacheMachine(RuleBasedStateMachine):
    """Requests admit (match, lock, ref, alloc), grow, finish (insert) or abort, while the cache evicts.

    `content[page]` is the token prefix whose KV the page holds (written by the request that
    allocated it), so a match that returns a wrong or recycled page is caught.
    """

    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(4, 24))
    def setup(self, page_size, num_pages):
        self.ps = page_size
        self.pool = PagePool(num_pages)
        self.radix = RadixCache(self.pool, page_size, "sim", on_evict=self.on_evict)
        self.reqs: list[SimReq] = []
        self.content: dict[int, tuple[int, ...]] = {}

    def on_evict(self, hashes, pages):
        # requests only hold tree pages through a lock, so an evicted page is the tree's alone
        assert all(self.pool.refcount(p) == 1 for p in pages)
        assert not any(p in r.pages for r in self.reqs for p in pages)
        last = self.content[pages[-1]]
        assert hashes == page_hashes(last, self.ps, "sim")[-len(pages):]

    def _prefix(self, tokens, i):
        return tuple(tokens[:min((i + 1) * self.ps, len(tokens))])

    def _grow(self, req, tokens):
        """Give req pages for tokens (evicting if needed); False if memory is short."""
        need = -(-len(tokens) // self.ps) - len(req.pages)
        if not self.pool.can_alloc(need):
            self.radix.evict(need - self.pool.num_free)
            self._purge()
        if not self.pool.can_alloc(need):
            return False
        req.pages += self.pool.alloc(need)
        req.tokens = tokens
        for i in range(req.matched, len(req.pages)):
            self.content[req.pages[i]] = self._prefix(tokens, i)
        return True

    def _purge(self):
        """Forget the content of pages the cache freed."""
        for p in [p for p in self.content if self.pool.refcount(p) == 0]:
            del self.content[p]

    def _drop(self, req):
        self.reqs.remove(req)
        self.radix.unlock(req.node)
        for p in self.pool.unref(req.pages):
            del self.content[p]

    @rule(tokens=tokens_st)
    def admit(self, tokens):
        cached = {self.content[p] for p in self.radix.all_pages()}
        expect = 0
        while expect < (len(tokens) - 1) // self.ps and self._prefix(tokens, expect) in cached:
            expect += 1
        m = self.radix.match(tokens[:-1])
        assert len(m.pages) == expect and m.num_tokens == expect * self.ps
        for i, p in enumerate(m.pages):
            assert self.content[p] == self._prefix(tokens, i)
        assert self.radix.hashes_for(m.node) == page_hashes(tokens[:m.num_tokens], self.ps, "sim")
        self.radix.lock(m.node)
        self.pool.ref(m.pages)
        req = SimReq([], list(m.pages), m.node, len(m.pages))
        self.reqs.append(req)
        if not self._grow(req, list(tokens)):
            self._drop(req)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def decode(self, i, more):
        req = self.reqs[i % len(self.reqs)]
        self._grow(req, req.tokens + more)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        req = self.reqs[i % len(self.reqs)]
        n = len(req.tokens) // self.ps
        present = self.radix.insert(req.tokens[:n * self.ps], req.pages[:n])
        assert req.matched <= present <= n
        self._drop(req)
        assert self.radix.match(req.tokens).num_tokens == n * self.ps

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        self._drop(self.reqs[i % len(self.reqs)])

    @rule(n=st.integers(-1, 12))
    def evict(self, n):
        free, evictable = self.pool.num_free, self.radix.num_evictable_pages
        freed = self.radix.evict(n)
        assert self.pool.num_free == free + freed
        assert freed >= min(max(n, 0), evictable)
        if n <= 0:
            assert freed == 0
        self._purge()

    @rule()
    def reset(self):
        protected = self.radix.num_protected_pages
        self.radix.reset()
        assert self.radix.num_cached_pages == protected and self.radix.num_evictable_pages == 0
        self._purge()

    @invariant()
    def consistent(self):
        self.radix.check_integrity()
        counts = check_pool_integrity(self.pool, self.radix, [r.pages for r in self.reqs])
        assert counts["cached"] == self.radix.num_evictable_pages
        assert set(self.content) == {p for p in range(self.pool.num_pages) if self.pool.refcount(p) > 0}
        for r in self.reqs:  # a live request's pages are never recycled under it
            assert len(r.pages) * self.ps >= len(r.tokens)
            for i, p in enumerate(r.pages):
                assert self.content[p] == self._prefix(r.tokens, i)


CacheMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_cache_machine = CacheMachine.TestCase


def test_salts_never_share_a_page_and_a_salt_root_goes_with_its_last_page():
    """cache_salt (http/tenant.py): each salt its own tree and hash chain; nothing crosses."""
    pool = PagePool(16)
    radix = RadixCache(pool, 2, namespace="m")
    ids = [1, 2, 3, 4, 5, 6]
    a, b = pool.alloc(3), pool.alloc(3)
    assert radix.insert(ids, a, salt="tenant-a") == 0
    assert radix.match(ids).pages == []  # the shared space has nothing
    assert radix.match(ids, salt="tenant-b").pages == []
    assert radix.match(ids, salt="tenant-a").pages == a
    assert radix.insert(ids, b, salt="tenant-b") == 0  # not "already cached": b's own pages
    assert radix.match(ids, salt="tenant-b").pages == b
    ha = radix.hashes_for(radix.match(ids, salt="tenant-a").node)
    hb = radix.hashes_for(radix.match(ids, salt="tenant-b").node)
    assert set(ha).isdisjoint(hb) and ha == page_hashes(ids, 2, "m", salt="tenant-a")
    assert set(ha).isdisjoint(page_hashes(ids, 2, "m"))
    assert radix.stats()["salts"] == 2
    pool.unref(a + b)
    radix.check_integrity()
    m = radix.match(ids, salt="tenant-a")
    radix.lock(m.node)
    assert radix.evict(16) == 3  # b's pages only: a's are locked
    assert "tenant-b" not in radix.roots and radix.match(ids, salt="tenant-b").pages == []
    radix.unlock(m.node)
    radix.check_integrity()
    assert radix.evict(16) == 3 and radix.roots == {} and radix.num_cached_pages == 0
    radix.check_integrity()
