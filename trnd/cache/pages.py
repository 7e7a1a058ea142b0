"""Page ids and their owners.

A page holds the KV of `page_size` consecutive tokens; the KV tensors live in the model runner,
this pool only decides which page ids are free and who owns the rest. Owners are requests (one
ref per page in their page table) and the radix cache (one ref per page it holds). A page goes back
on the free list when its last owner lets go.

Allocation is LIFO: the most recently freed page is handed out first (a fresh pool hands out
0, 1, 2, ...). Deterministic for a given history, and it reuses pages that are warm in caches.
"""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id first

    @property
    def num_pages(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages, each with one owner (the caller). Callers check `can_alloc` first."""
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if n > len(self._free):
            raise MemoryError(f"alloc: need {n} pages, only {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def ref(self, pages: Iterable[int]) -> None:
        """Add one owner to each page. The pages must be allocated: a free page has no owner to share it."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if self._refs[p] <= 0:
                raise ValueError(f"ref: page {p} is free")
        for p in pages:
            self._refs[p] += 1

    def unref(self, pages: Iterable[int]) -> list[int]:
        """Drop one owner from each page; returns the pages that became free (in the given order).

        Dropping an owner of a free page is a double free, a bug in the caller: it raises, and
        changes nothing when it does.
        """
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            self._check_id(p)
            drops[p] = drops.get(p, 0) + 1
            if drops[p] > self._refs[p]:
                raise ValueError(f"unref: page {p} is free (double free)")
        freed = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                freed.append(p)
        self._free.extend(reversed(freed))  # the first freed page is the next one handed out
        return freed

    def check_integrity(self) -> None:
        """The free list holds exactly the pages with no owner, each once."""
        assert len(set(self._free)) == len(self._free), "free list has duplicates"
        free = set(self._free)
        for p, r in enumerate(self._refs):
            assert r >= 0, f"page {p} has refcount {r}"
            assert (r == 0) == (p in free), f"page {p}: refcount {r} but on free list: {p in free}"

    def _check_id(self, page: int) -> None:
        if not 0 <= page < len(self._refs):
            raise IndexError(f"page {page} out of range [0, {len(self._refs)})")

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self.num_pages}, free={self.num_free})"
