import hashlib

import pytest

from trnd.cache.hashing import hash_hex, page_hashes, root_hash
from trnd.cache.pages import PagePool


# ---- PagePool ------------------------------------------------------------------------------------

def test_fresh_pool_allocates_lowest_ids_first():
    pool = PagePool(8)
    assert pool.num_pages == 8 and pool.num_free == 8
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.num_free == 5
    assert [pool.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert pool.alloc(0) == []
    pool.check_integrity()


def test_alloc_is_lifo_on_freed_pages():
    pool = PagePool(8)
    pages = pool.alloc(4)
    assert pool.unref([pages[1], pages[3]]) == [1, 3]
    # the first freed page comes back first, then the next one, then untouched pages
    assert pool.alloc(3) == [1, 3, 4]
    pool.check_integrity()


def test_can_alloc_and_memory_error_message():
    pool = PagePool(4)
    pool.alloc(3)
    assert pool.can_alloc(1) and not pool.can_alloc(2)
    assert not pool.can_alloc(-1)
    with pytest.raises(MemoryError, match=r"need 2 pages, only 1 of 4 free"):
        pool.alloc(2)
    assert pool.num_free == 1  # a failed alloc takes nothing
    with pytest.raises(ValueError):
        pool.alloc(-1)


def test_ref_unref_returns_pages_that_became_free():
    pool = PagePool(4)
    a, b = pool.alloc(2)
    pool.ref([a])
    assert pool.refcount(a) == 2
    assert pool.unref([a, b]) == [b]
    assert pool.refcount(a) == 1 and pool.refcount(b) == 0
    assert pool.num_free == 3
    assert pool.unref([a]) == [a]
    assert pool.num_free == 4
    pool.check_integrity()


def test_unref_same_page_twice_in_one_call():
    pool = PagePool(2)
    (a,) = pool.alloc(1)
    pool.ref([a])
    assert pool.unref([a, a]) == [a]
    assert pool.num_free == 2
    pool.check_integrity()


def test_double_free_raises_and_changes_nothing():
    pool = PagePool(4)
    a, b = pool.alloc(2)
    pool.unref([a])
    with pytest.raises(ValueError, match="double free"):
        pool.unref([a])
    with pytest.raises(ValueError, match="double free"):
        pool.unref([b, b])  # b has one owner only
    assert pool.refcount(b) == 1 and pool.num_free == 3
    pool.check_integrity()


def test_ref_of_free_page_and_bad_ids_raise():
    pool = PagePool(2)
    with pytest.raises(ValueError, match="free"):
        pool.ref([0])
    (a,) = pool.alloc(1)
    with pytest.raises(ValueError):
        pool.ref([a, 1])  # all-or-nothing
    assert pool.refcount(a) == 1
    with pytest.raises(IndexError):
        pool.refcount(2)
    with pytest.raises(IndexError):
        pool.unref([-1])


def test_check_integrity_detects_corrupt_free_list():
    pool = PagePool(3)
    pool.alloc(1)
    pool._free.append(0)  # page 0 is owned but also on the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ---- hashing -------------------------------------------------------------------------------------

def test_page_hashes_golden_values():
    # Pins the key space: sha256 chain over little-endian int32 tokens, rooted at sha256(namespace).
    ns = "llama-3-8b/bf16/ps2"
    hs = page_hashes([1, 2, -1, 70000, 5], 2, ns)
    assert [h.hex() for h in hs] == [
        "814c437f87f6d5903ed7c4cf832a8ab60117229cdf3437aad9b85b6cdf990412",
        "1fff36a2126fe92d40b4f9a7fd8f98ad65ced44c6deb27d514ab72500d56f0d8",
    ]
    r = hashlib.sha256(ns.encode()).digest()
    assert root_hash(ns) == r
    h0 = hashlib.sha256(r + bytes.fromhex("0100000002000000")).digest()
    assert hs[0] == h0
    assert hs[1] == hashlib.sha256(h0 + bytes.fromhex("ffffffff70110100")).digest()


def test_page_hashes_full_pages_only():
    assert page_hashes([1, 2, 3], 4, "m") == []
    assert len(page_hashes(list(range(9)), 4, "m")) == 2
    assert all(len(h) == 32 for h in page_hashes(list(range(8)), 1, "m"))


def test_page_hashes_chain_and_parent_continuation():
    ids = list(range(12))
    full = page_hashes(ids, 3, "m")
    head = page_hashes(ids[:6], 3, "m")
    tail = page_hashes(ids[6:], 3, "m", parent=head[-1])
    assert full == head + tail
    # a hash depends on the whole prefix, not just its own page
    assert page_hashes([9, 9, 9] + ids[3:6], 3, "m")[1] != full[1]


def test_page_hashes_namespace_separation():
    ids = list(range(8))
    assert set(page_hashes(ids, 4, "model-a")).isdisjoint(page_hashes(ids, 4, "model-b"))


def test_page_hashes_rejects_bad_input():
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0, "m")
    with pytest.raises(ValueError):
        page_hashes([1, 2], 2, "m", parent=b"short")
    with pytest.raises(ValueError, match="int32"):
        page_hashes([1, 2**31], 2, "m")


def test_hash_hex():
    h = page_hashes([1, 2], 2, "m")[0]
    assert hash_hex(h, None) == h.hex()
    assert hash_hex(h) == h.hex()[:16]
    assert hash_hex(h, 8) == h.hex()[:8]
