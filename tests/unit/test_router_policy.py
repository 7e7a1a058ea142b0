"""The router's choice as plain functions: fit, session (rendezvous), prefix, load."""

from __future__ import annotations

import pytest

from trnd.router.policy import NoTarget, PrefixIndex, choose, fitting, prefix_hashes, rendezvous
from trnd.router.targets import Target


def targets(*specs) -> list[Target]:
    return [Target(f"10.0.0.{i}:8000", healthy=True, max_model_len=ctx, in_flight=load)
            for i, (ctx, load) in enumerate(specs)]


def test_rendezvous_moves_only_the_lost_targets_sessions():
    ts = targets(*[(8192, 0)] * 4)
    keys = [f"session-{i}" for i in range(400)]
    before = {k: rendezvous(k, ts).addr for k in keys}
    assert len(set(before.values())) == 4  # spread over all
    lost = ts[1]
    after = {k: rendezvous(k, [t for t in ts if t is not lost]).addr for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == lost.addr for k in moved)


def test_fit_takes_the_smallest_context_that_holds_the_request():
    ts = targets((8192, 0), (131072, 0), (8192, 5))
    assert {t.max_model_len for t in fitting(ts, 4000)} == {8192}
    assert [t.max_model_len for t in fitting(ts, 9000)] == [131072]
    with pytest.raises(NoTarget, match="needs 200000 tokens.*largest context served is 131072") as e:
        choose(ts, 200_000, None, [], PrefixIndex(10), 4)
    assert not e.value.fits


def test_no_healthy_target_is_unavailable():
    with pytest.raises(NoTarget) as e:
        choose([], 10, None, [], PrefixIndex(10), 4)
    assert e.value.fits


def test_session_wins_over_load_and_is_stable():
    ts = targets((8192, 0), (8192, 50))
    t, rule = choose(ts, 10, "abc", [], PrefixIndex(10), 0)
    assert rule == "session" and all(choose(ts, 10, "abc", [], PrefixIndex(10), 0)[0] is t for _ in range(5))


def test_prefix_holder_wins_unless_it_is_too_loaded():
    ts = targets((8192, 3), (8192, 0))
    index = PrefixIndex(100)
    h = prefix_hashes("x" * 1000, 256)
    assert len(h) == 3
    index.record(h, ts[0].addr)
    assert choose(ts, 10, None, h + [123], index, slack=4) == (ts[0], "prefix")
    assert choose(ts, 10, None, h, index, slack=2) == (ts[1], "load")  # 3 in flight > 0 + 2
    assert choose(ts, 10, None, prefix_hashes("y" * 1000, 256), index, slack=4) == (ts[1], "load")


def test_prefix_hashes_are_chained():
    a, b = prefix_hashes("a" * 512 + "b" * 256, 256), prefix_hashes("c" * 256 + "a" * 256 + "b" * 256, 256)
    assert a[1] != b[2] or a[0] != b[1]  # the same block after a different prefix hashes differently
    assert prefix_hashes("a" * 600, 256) == prefix_hashes("a" * 512 + "z" * 88, 256)  # partial blocks ignored


def test_index_is_bounded_and_forgets_a_target():
    index = PrefixIndex(4)
    index.record([1, 2, 3], "a")
    index.record([4, 5], "b")
    assert len(index.map) == 4 and 1 not in index.map
    index.forget("b")
    assert set(index.map) == {2, 3}
    assert index.longest([1, 2, 3], {"a"}) == (None, 0)  # block 1 (the first) was dropped: no prefix
    assert index.longest([2, 3, 9], {"a"}) == ("a", 2)


def test_excluded_targets_are_not_retried():
    ts = targets((8192, 0), (8192, 0))
    t, _ = choose(ts, 10, "s", [], PrefixIndex(10), 4)
    other, _ = choose(ts, 10, "s", [], PrefixIndex(10), 4, exclude={t.addr})
    assert other is not t
    with pytest.raises(NoTarget, match="left to retry"):
        choose(ts, 10, "s", [], PrefixIndex(10), 4, exclude={t.addr, other.addr})


def test_random_baseline_ignores_sessions():
    ts = targets((8192, 0), (8192, 0))
    got = {choose(ts, 10, "same", [], PrefixIndex(10), 4, spray=i)[0].addr for i in range(16)}
    assert got == {t.addr for t in ts}  # one session, both targets
    assert all(choose(ts, 10, "same", [], PrefixIndex(10), 4, spray=i)[1] == "random" for i in range(4))


def test_session_and_prefix_maps_are_bounded_and_their_bytes_measured():
    """Before: the router kept every session id as the client sent it (4,000 ids of 62 KB: +214-233 MB). Ids
    are hashed to 32 characters on entry and both maps drop their least recently used entries at capacity;
    the byte gauges' per-entry sizes are what tracemalloc measures here (within a quarter)."""
    import random
    import tracemalloc

    from trnd.http.session import session_key
    from trnd.router.policy import PREFIX_ENTRY_BYTES, SESSION_ENTRY_BYTES, PrefixIndex, Sessions

    assert len(session_key("x" * 2**21)) == 32 and session_key("a\nb\0\udcff") != session_key("a")
    s, p = Sessions(1000), PrefixIndex(1000)
    for i in range(5000):
        s.record(session_key(f"s{i}" * 1000), "a:1" if i % 2 else "b:1")
    p.record(list(range(5000)), "a:1")
    assert len(s.map) == 1000 and len(p.map) == 1000 and session_key("s4999" * 1000) in s.map
    assert sum(s.per_target().values()) == 1000 and s.nbytes == 1000 * SESSION_ENTRY_BYTES
    tracemalloc.start()
    try:
        for cls, make, each in ((Sessions, lambda i: session_key(str(i)), SESSION_ENTRY_BYTES),
                                (PrefixIndex, lambda i: random.getrandbits(64), PREFIX_ENTRY_BYTES)):
            m, before = cls(10**6), tracemalloc.get_traced_memory()[0]
            keys = [make(i) for i in range(20000)]
            for k in keys:
                m.record(k, "a:1") if cls is Sessions else m.record([k], "a:1")
            per = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
            del m, keys
            assert 0.75 * each < per < 1.25 * each, (cls.__name__, per)
    finally:
        tracemalloc.stop()
