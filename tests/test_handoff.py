"""The KV handoff ledgers (transfer/handoff.py) alone, and the scheduler's parked contract driven by a
peer source built on them (what roles/decode.py does, without sockets or a model)."""

from __future__ import annotations

from types import SimpleNamespace

from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache, check_pool_integrity
from trnd.engine.parked import Landing, Parked
from trnd.engine.request import Req, SamplingParams, Status
from trnd.engine.scheduler import Scheduler, SchedulerConfig
from trnd.transfer.handoff import Awaited, Shipped, Xfer

# -- prefill: Shipped ---------------------------------------------------------------------------------


def test_shipped_sends_whole_pages_while_prefilling_and_the_tail_at_the_end():
    led = Shipped()
    s = led.add("p1/a", "a", peer=1, skip_pages=1, dst_pages=[10, 11, 12])
    assert Shipped.pages_ready(s, 20, 40, 16, pipeline=True) == range(1, 1)  # page 1 not complete yet
    got = Shipped.pages_ready(s, 33, 40, 16, pipeline=True)
    assert got == range(1, 2)
    Shipped.shipped(s, got, Xfer("h1", [5], 100, 0.0))
    assert Shipped.pages_ready(s, 33, 40, 16, pipeline=True) == range(0)  # nothing new
    assert Shipped.pages_ready(s, 40, 40, 16, pipeline=False) == range(2, 3)  # the partial last page too
    assert Shipped.pages_ready(s, 33, 40, 16, pipeline=False) == range(0)  # no pipelining: only at the end
    s.aborted = True
    assert Shipped.pages_ready(s, 40, 40, 16, pipeline=True) == range(0)


def test_shipped_holds_until_every_write_ends_then_answers_aborted_once():
    led = Shipped()
    s = led.add("p1/a", "a", peer=1, skip_pages=0, dst_pages=[10, 11])
    Shipped.shipped(s, range(0, 1), Xfer("h1", [5], 100, 0.0))
    Shipped.shipped(s, range(1, 2), Xfer("h2", [6], 100, 0.0))
    assert led.held_pages() == [[5], [6]]
    s.aborted = True
    assert led.settle("p1/a") is None  # writes still reading pages 5 and 6
    states = {"h1": "DONE", "h2": "PROC"}
    ended = led.reap(states.get)
    assert [(x.handle, ok) for _, _, x, ok in ended] == [("h1", True)]
    assert led.settle("p1/a") is None and led.held_pages() == [[6]]
    states["h2"] = "ERR"
    assert [(x.handle, ok) for _, _, x, ok in led.reap(states.get)] == [("h2", False)]
    assert led.settle("p1/a") == "aborted" and len(led) == 0
    assert led.settle("p1/a") is None  # forgotten: Aborted is said once


def test_shipped_done_is_forgotten_and_peers_are_found():
    led = Shipped()
    a = led.add("p1/a", "a", 1, 0, [1])
    led.add("p2/b", "b", 2, 0, [2])
    assert led.of_peer(2) == ["p2/b"]
    assert led.settle("p1/a") is None  # neither done nor aborted
    a.done = True
    assert led.settle("p1/a") == "done" and led.get("p1/a") is None


# -- decode: Awaited ----------------------------------------------------------------------------------

KVDone = SimpleNamespace


def test_awaited_lands_when_kvdone_and_every_notification_are_in():
    led = Awaited()
    led.expect("a", "peer1", [4, 5], now=0.0)
    led.notified("a")
    assert not led.landed("a") and not led.ended("a")
    led.kv_done("a", KVDone(num_xfers=2))
    assert not led.landed("a")  # one write still to land
    led.notified("a")
    assert led.landed("a") and led.ended("a")
    led.notified("zzz")  # a stray notification is ignored
    assert led.forget("a").notifs == 2 and len(led) == 0


def test_awaited_fence_waits_for_the_peer_unless_it_is_gone():
    led = Awaited()
    led.expect("a", "p", [4], 0.0)
    led.expect("b", "p", [5], 0.0)
    assert led.fence("a", connected=True) and not led.ended("a")
    led.kv_done("a", KVDone(num_xfers=0))
    assert not led.landed("a")  # fenced: never lands
    led.aborted("a")
    assert led.entries["a"].over == "aborted" and led.ended("a")
    assert not led.fence("b", connected=False) and led.entries["b"].over == "aborted"


def test_awaited_prefill_failure_is_an_abort_when_fenced():
    led = Awaited()
    led.expect("a", "p", [4], 0.0)
    led.expect("b", "p", [5], 0.0)
    led.fence("b", connected=True)
    led.failed("a", "too long")
    led.failed("b", "whatever")
    assert (led.entries["a"].over, led.entries["a"].reason) == ("failed", "too long")
    assert led.entries["b"].over == "aborted"


def test_awaited_prefill_failure_past_the_deadline_is_this_sides_timeout():
    """The peer saying 'deadline passed' before this side's own check ran is still a timeout (504), and,
    the peer having nothing in flight, nothing is cut."""
    led = Awaited()
    led.expect("a", "p", [4], 10.0, deadline=12.0)
    led.expect("b", "p", [5], 10.0, deadline=12.0)
    led.failed("a", "handoff deadline passed before the KV was written", now=12.001)
    led.failed("b", "bad prompt", now=11.0)
    assert led.entries["a"].over == "timeout" and "did not deliver the KV within 2 s" in led.entries["a"].reason
    assert led.cut == {} and led.overdue(13.0) == []
    assert (led.entries["b"].over, led.entries["b"].reason) == ("failed", "bad prompt")


def test_awaited_lost_peer_quarantines_target_pages_for_fence_s():
    led = Awaited()
    led.expect("a", "p1", [4, 5], 0.0)
    led.expect("b", "p2", [6], 0.0)
    led.expect("c", "p1", [7], 0.0)
    led.fence("c", connected=True)  # fenced entries are quarantined too: a write may be on the wire
    lost = led.peer_lost("p1", now=10.0, fence_s=2.0)
    assert sorted(a.rid for a in lost) == ["a", "c"] and led.quarantined_pages() == 3
    assert led.outstanding("p1") == 0 and led.outstanding("p2") == 1
    assert led.expire(11.9) == [] and led.expire(12.0) == [[4, 5], [7]]
    assert led.quarantined_pages() == 0


# -- the scheduler's parked contract with a peer source ------------------------------------------------

class FakePeer:
    """A prefill peer's source as roles/decode.py builds it, on the Awaited ledger."""

    def __init__(self, retries: int = 1):
        self.awaited, self.retries, self.held = Awaited(), retries, []

    def ask(self, req: Req) -> Parked:
        src = self
        req.handoffs += 1
        src.awaited.expect(req.rid, "p", req.pages[req.num_cached // 4:], 0.0)

        class Job(Parked):
            phase = "waiting_for_kv"

            def done(self):
                return src.awaited.ended(self.req.rid)

            def abort(self):
                super().abort()
                src.awaited.fence(self.req.rid, connected=True)

            def result(self):
                a = src.awaited.forget(self.req.rid)
                if self.aborted or a.over == "aborted":
                    return Landing()
                if a.over is None:
                    return Landing(first="tok", computed_tokens=len(self.req.prompt_ids))
                if a.over == "lost":
                    return Landing(retry=True) if self.req.handoffs <= src.retries else Landing(error=OSError("lost"))
                return Landing(error=OSError(a.reason))
        return Job(req)


def setup(num_pages=16):
    pool = PagePool(num_pages)
    radix = RadixCache(pool, 4)
    s = Scheduler(SchedulerConfig(page_size=4, token_budget=64, chunk_size=64), pool, radix)
    peer = FakePeer()
    s.peer = peer.ask
    return s, pool, radix, peer


def owners(s, peer_held):
    return s.owner_lists() + peer_held


def test_a_peer_request_parks_with_every_prompt_page_then_decodes():
    s, pool, radix, peer = setup()
    r = Req(list(range(10)), SamplingParams(max_tokens=4))
    s.add(r)
    b = s.schedule()
    assert b.empty and r.rid in s.parked and len(r.pages) == 3 and s.has_work
    assert s.find(r.rid) is r
    check_pool_integrity(pool, radix, owners(s, []))
    peer.awaited.kv_done(r.rid, KVDone(num_xfers=1))
    assert s.schedule().arrived == []  # the write's notification is not in yet
    peer.awaited.notified(r.rid)
    b = s.schedule()
    assert [q for q, _ in b.arrived] == [r] and b.arrived[0][1].first == "tok"
    assert r.num_computed == 10 and r in s.running and not s.parked
    assert b.decode == []  # its first token is delivered; it decodes from the next step


def test_an_aborted_peer_request_keeps_its_pages_until_the_peer_confirms():
    s, pool, radix, peer = setup()
    r = Req(list(range(10)), SamplingParams(max_tokens=4))
    s.add(r)
    s.schedule()
    s.finish(r, "abort")
    assert s.find(r.rid) is None and pool.num_free == 13  # fenced: still held
    s.schedule()
    assert pool.num_free == 13
    peer.awaited.aborted(r.rid)
    s.schedule()
    assert pool.num_free == 16 and not s.parked and not s.has_work


def test_a_lost_peer_retries_once_then_fails_and_quarantined_pages_stay_held():
    s, pool, radix, peer = setup()
    r = Req(list(range(10)), SamplingParams(max_tokens=4))
    s.add(r)
    s.schedule()
    for a in peer.awaited.peer_lost("p", now=0.0, fence_s=5.0):
        pool.ref(a.target)  # the role holds the quarantine (Engine.hold)
        peer.held.append(a.target)
    b = s.schedule()  # retried: released, back in the queue, then admitted again and parked on a new ask
    assert r.rid in s.parked and r.handoffs == 2 and not b.failed
    check_pool_integrity(pool, radix, owners(s, peer.held))
    for a in peer.awaited.peer_lost("p", now=0.0, fence_s=5.0):
        pool.ref(a.target)
        peer.held.append(a.target)
    b = s.schedule()
    assert [(q, str(e)) for q, e in b.failed] == [(r, "lost")] and r.status is Status.FINISHED
    check_pool_integrity(pool, radix, owners(s, peer.held))
    for pages in peer.awaited.expire(5.0):
        pool.unref(pages)
    assert pool.num_free == 16


def test_a_prefill_failure_fails_the_request_and_frees_its_pages():
    s, pool, radix, peer = setup()
    r = Req(list(range(10)), SamplingParams(max_tokens=4))
    s.add(r)
    s.schedule()
    peer.awaited.failed(r.rid, "bad prompt")
    b = s.schedule()
    assert [str(e) for _, e in b.failed] == ["bad prompt"] and pool.num_free == 16


def test_awaited_is_landing_only_while_a_done_handoffs_notifications_are_due():
    """What the decode loop polls fast for: a KVDone in, its writes' notifications not all yet. A handoff
    still computing on its peer is not polled for (the KVDone's arrival wakes the loop)."""
    from types import SimpleNamespace

    led = Awaited()
    led.expect("a", "p", [4, 5], 0.0)
    assert not led.landing()  # computing on the peer
    led.kv_done("a", SimpleNamespace(num_xfers=2))
    assert led.landing()
    led.notified("a")
    assert led.landing()
    led.notified("a")
    assert not led.landing() and led.landed("a")
