"""Radix prefix cache over whole pages.

Edges are token-id sequences whose length is a multiple of page_size, and a node splits only at
page boundaries, so a match always ends on a page boundary and a node's pages can be shared as-is.
The tree holds one pool ref for each page in it; requests that reuse a prefix take their own refs.

Protocol for the engine:
    m = radix.match(ids)                        # no refs, no locks; may split a node
    radix.lock(m.node); pool.ref(m.pages)       # borrow the prefix for the request's lifetime
    ...                                         # request computes and owns its other pages
    radix.insert(full_page_ids, req_pages)      # on finish: the tree takes refs on new pages
    radix.unlock(m.node); pool.unref(req_pages) # request lets go of everything it held

Each cache salt (a tenant: hashing.py) has its own root, so no match, insert or page crosses salts;
the unsalted root is `root`, a salt's root is made on its first insert and dropped with its last page.

Locks count on a node and all its ancestors, so a node is locked whenever any node below it is.
Eviction removes whole unlocked leaves, least recently used first (a parent becomes a candidate
once its last child is gone); it can therefore free more pages than asked for. A split keeps the
original node object as the tail, so a node handed out by match (and locked) stays valid.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from trnd.cache.hashing import page_hashes
from trnd.cache.pages import PagePool


class Node:
    __slots__ = ("parent", "children", "key", "pages", "hashes", "lock", "last_access", "id", "salt")

    def __init__(self, parent: Node | None, key: tuple[int, ...], pages: list[int], hashes: list[bytes],
                 node_id: int):
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the child's first page of tokens
        self.key = key  # edge label: the tokens of this node's pages
        self.pages = pages
        self.hashes = hashes  # chained page hash of each page (see hashing.py)
        self.lock = 0  # active locks on this node or below it
        self.last_access = 0
        self.id = node_id
        self.salt: str | None = None  # set on roots only: the cache salt of the tree below

    def __repr__(self) -> str:
        return f"Node(id={self.id}, pages={len(self.pages)}, lock={self.lock}, children={len(self.children)})"


@dataclass(slots=True)
class MatchResult:
    node: Node  # deepest matched node (the root when nothing matched)
    pages: list[int]  # matched pages, in order
    num_tokens: int  # len(pages) * page_size


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int, namespace: str = "",
                 on_evict: Callable[[list[bytes], list[int]], None] | None = None):
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.pool = pool
        self.page_size = page_size
        self.namespace = namespace
        # Called with (hashes, pages) of an evicted node before its pages are unref'ed, so a host
        # tier can copy the KV out first.
        self.on_evict = on_evict
        # KV events (trnd/events/record.py Recorder): told of every page that enters or leaves the tree
        self.events = None
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = Node(None, (), [], [], next(self._ids))
        self.roots: dict[str, Node] = {}  # cache salt -> its root (the unsalted one is self.root)
        self._num_cached = 0
        self._num_protected = 0
        self._num_nodes = 0  # excluding the root
        self.hit_tokens = 0
        self.query_tokens = 0
        self.evicted_pages = 0  # pages dropped from the tree by evict/reset

    # ---- lookups -------------------------------------------------------------------------------

    def root_of(self, salt: str | None, create: bool = False) -> Node | None:
        """The root of `salt`'s tree (None: the unsalted root); None when it has none and not create."""
        if not salt:
            return self.root
        node = self.roots.get(salt)
        if node is None and create:
            node = self.roots[salt] = Node(None, (), [], [], next(self._ids))
            node.salt = salt
        return node

    def match(self, token_ids: Sequence[int], salt: str | None = None) -> MatchResult:
        """Longest cached prefix of token_ids in whole pages, under `salt` only. Takes no refs and no locks.

        Callers that must compute at least one token (to get logits) pass token_ids[:-1].
        """
        ps = self.page_size
        tokens = tuple(token_ids[:len(token_ids) // ps * ps])
        tick = next(self._clock)
        node = self.root_of(salt)
        if node is None:  # a salt with nothing cached: its root is made by the first insert
            self.query_tokens += len(token_ids)
            return MatchResult(Node(None, (), [], [], -1), [], 0)
        node.last_access = tick
        pages: list[int] = []
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:
                break
            m = self._common_pages(child.key, tokens, pos)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = tick
            pages.extend(child.pages)
            node = child
            pos += m * ps
        self.hit_tokens += pos
        self.query_tokens += len(token_ids)
        return MatchResult(node, pages, pos)

    def hashes_for(self, node: Node) -> list[bytes]:
        """Chained page hashes of every page from the root down to node, in order."""
        chain = []
        while node is not None:
            chain.append(node.hashes)
            node = node.parent
        return [h for hs in reversed(chain) for h in hs]

    def all_pages(self) -> Iterator[int]:
        for node in self._nodes():
            yield from node.pages

    # ---- locks ---------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Protect node and its ancestors from eviction (one lock per borrowing request)."""
        self._check_attached(node)
        while node is not None:
            if node.lock == 0:
                self._num_protected += len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        self._check_attached(node)
        n = node
        while n is not None:
            if n.lock <= 0:
                raise ValueError(f"unlock: {n} is not locked (unlock without lock)")
            n = n.parent
        while node is not None:
            node.lock -= 1
            if node.lock == 0:
                self._num_protected -= len(node.pages)
            node = node.parent

    # ---- insert / evict ------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], salt: str | None = None) -> int:
        """Cache pages for the full-page token_ids under `salt`; returns how many leading pages were
        already cached.

        For pages not yet in the tree the tree takes its own ref. For leading pages already present
        the tree keeps its page and ignores the caller's; either way the caller keeps its refs.
        """
        ps = self.page_size
        assert len(token_ids) == len(pages) * ps, \
            f"insert: {len(token_ids)} tokens for {len(pages)} pages of {ps}"
        tokens = tuple(token_ids)
        if not tokens:
            return 0
        tick = next(self._clock)
        node = self.root_of(salt, create=True)
        node.last_access = tick
        pos = 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:
                new_pages = list(pages[pos // ps:])
                hashes = page_hashes(tokens[pos:], ps, self.namespace, node.hashes[-1] if node.hashes else b"", salt)
                self.pool.ref(new_pages)
                leaf = Node(node, tokens[pos:], new_pages, hashes, next(self._ids))
                leaf.last_access = tick
                node.children[tokens[pos:pos + ps]] = leaf
                if self.events is not None:
                    self.events.stored(node.hashes[-1] if node.hashes else None, hashes, tokens[pos:], salt)
                self._num_cached += len(new_pages)
                self._num_nodes += 1
                break
            m = self._common_pages(child.key, tokens, pos)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = tick
            node = child
            pos += m * ps
        return pos // ps

    def evict(self, num_pages: int) -> int:
        """Evict LRU unlocked leaves until num_pages pages are freed in the pool or nothing is left.

        Returns the pages actually freed. Whole nodes go, so this may free more than asked. A tree
        page that someone else still refs is dropped from the tree but not counted (nor freed).
        """
        if num_pages <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._nodes()
                if not n.children and n.lock == 0 and n.parent is not None]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if self.on_evict is not None:
                self.on_evict(list(node.hashes), list(node.pages))
            if self.events is not None:
                self.events.removed(node.hashes)
            freed += len(self.pool.unref(node.pages))
            del parent.children[node.key[:self.page_size]]
            node.parent = None
            self._num_cached -= len(node.pages)
            self._num_nodes -= 1
            self.evicted_pages += len(node.pages)
            if parent.parent is not None and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
            elif parent.salt is not None and not parent.children and parent.lock == 0:
                del self.roots[parent.salt]  # a salt's last page: its root goes too
        return freed

    def reset(self) -> int:
        """Evict everything that is not locked; returns pages freed."""
        return self.evict(self._num_cached)

    # ---- accounting ----------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached

    @property
    def num_protected_pages(self) -> int:
        return self._num_protected

    @property
    def num_evictable_pages(self) -> int:
        return self._num_cached - self._num_protected

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def stats(self) -> dict:
        return {
            "cached_pages": self.num_cached_pages,
            "evictable_pages": self.num_evictable_pages,
            "protected_pages": self.num_protected_pages,
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "evicted_pages": self.evicted_pages,
            "nodes": self._num_nodes,
            "salts": len(self.roots),
        }

    def check_integrity(self, strict: bool = True) -> None:
        """Assert the tree's invariants.

        strict: pages of unlocked nodes are held by the tree alone (refcount 1). True whenever
        requests only hold tree pages through a lock, i.e. between engine steps; it is briefly
        false between a finishing request's insert and its unref.
        """
        ps = self.page_size
        for root in (self.root, *self.roots.values()):
            assert not root.key and not root.pages and root.parent is None
        for salt, root in self.roots.items():
            assert root.salt == salt and salt, f"salt root {salt!r} names {root.salt!r}"
        seen: set[int] = set()
        cached = protected = nodes = 0
        salt_of: dict[int, str | None] = {}
        for node in self._nodes():
            child_locks = 0
            for k, child in node.children.items():
                assert child.parent is node, f"{child}: parent link broken"
                assert child.key[:ps] == k, f"{child}: keyed by {k[:8]}..., first page {child.key[:8]}..."
                child_locks += child.lock
            assert node.lock >= child_locks, f"{node}: lock {node.lock} < children's {child_locks}"
            if node.parent is None:
                salt_of[node.id] = node.salt
                continue
            salt_of[node.id] = salt_of[node.parent.id]
            nodes += 1
            n = len(node.pages)
            assert n >= 1 and len(node.key) == n * ps, f"{node}: {len(node.key)} tokens for {n} pages"
            parent_hash = node.parent.hashes[-1] if node.parent.hashes else b""
            assert node.hashes == page_hashes(node.key, ps, self.namespace, parent_hash, salt_of[node.id]), \
                f"{node}: bad hashes"
            cached += n
            protected += n if node.lock > 0 else 0
            for p in node.pages:
                assert p not in seen, f"page {p} appears twice in the tree"
                seen.add(p)
                rc = self.pool.refcount(p)
                assert rc >= 1, f"tree page {p} has refcount {rc}"
                if strict and node.lock == 0:
                    assert rc == 1, f"page {p} of unlocked {node} has refcount {rc}, expected 1"
        assert cached == self._num_cached, f"cached pages {cached} != counter {self._num_cached}"
        assert protected == self._num_protected, f"protected pages {protected} != counter {self._num_protected}"
        assert nodes == self._num_nodes, f"nodes {nodes} != counter {self._num_nodes}"

    # ---- internals -----------------------------------------------------------------------------

    def _nodes(self) -> Iterator[Node]:
        """Every node, each root before the nodes below it."""
        stack = [*self.roots.values(), self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """Number of leading whole pages on which key and tokens[pos:] agree."""
        ps = self.page_size
        n = min(len(key), len(tokens) - pos) // ps
        i = 0
        while i < n and key[i * ps:(i + 1) * ps] == tokens[pos + i * ps:pos + (i + 1) * ps]:
            i += 1
        return i

    def _split(self, node: Node, m: int) -> Node:
        """Cut node after its first m pages; the new head takes node's place, node keeps the tail."""
        ps = self.page_size
        head = Node(node.parent, node.key[:m * ps], node.pages[:m], node.hashes[:m], next(self._ids))
        head.lock = node.lock  # the same requests lock both halves; protected page count unchanged
        head.last_access = node.last_access
        node.parent.children[head.key[:ps]] = head
        node.key, node.pages, node.hashes = node.key[m * ps:], node.pages[m:], node.hashes[m:]
        node.parent = head
        head.children[node.key[:ps]] = node
        self._num_nodes += 1
        return head

    def _check_attached(self, node: Node) -> None:
        if node.parent is None and node is not self.root and self.roots.get(node.salt) is not node:
            raise ValueError(f"{node} is no longer in the tree (evicted)")


def check_pool_integrity(pool: PagePool, radix: RadixCache, request_page_lists: Iterable[list[int]]) -> dict:
    """Assert every page's refcount == (#request page lists holding it) + (1 if in the tree).

    request_page_lists: the page table of every live request (pages it holds a ref on); any other
    long-lived owner (e.g. a reserved dummy page) must be passed as a list too.
    Returns {free, cached, in_use, total}: cached = held by the tree only, in_use = held by >= 1 request.
    """
    pool.check_integrity()
    held = Counter(p for pages in request_page_lists for p in pages)
    tree = Counter(radix.all_pages())
    bad = [p for p in (held | tree) if not 0 <= p < pool.num_pages]
    assert not bad, f"pages out of range [0, {pool.num_pages}): {bad[:8]}"
    dup = [p for p, c in tree.items() if c > 1]
    assert not dup, f"pages in the tree more than once: {dup[:8]}"
    counts = {"free": 0, "cached": 0, "in_use": 0, "total": pool.num_pages}
    for p in range(pool.num_pages):
        rc = pool.refcount(p)
        assert rc == held[p] + tree[p], \
            f"page {p}: refcount {rc}, expected {held[p]} request refs + {tree[p]} tree ref"
        if rc == 0:
            counts["free"] += 1
        elif held[p]:
            counts["in_use"] += 1
        else:
            counts["cached"] += 1
    assert counts["free"] == pool.num_free
    assert counts["free"] + counts["cached"] + counts["in_use"] == counts["total"]
    return counts
