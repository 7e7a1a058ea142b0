"""The KV handoff as one component: the ledgers (transfer/handoff.py), the transfers in flight
(transfer/inflight.py), and decode's Inbox (roles/inbox.py) driven by the real scheduler's parked
contract, with a fake engine and peer link instead of sockets and a model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache, check_pool_integrity
from trnd.engine.request import Req, SamplingParams, Status
from trnd.engine.scheduler import Scheduler, SchedulerConfig
from trnd.roles.inbox import Inbox, PeerLink
from trnd.transfer import protocol as wire
from trnd.transfer.handoff import Awaited, Shipped
from trnd.transfer.inflight import InFlight
from trnd.transfer.metrics import TransferMetrics


class FakeAgent:
    """NIXL's answers for posted handles: "PROC" until the test says otherwise."""

    def __init__(self):
        self.states, self.released = {}, []

    def state(self, handle) -> str:
        return self.states.get(handle, "PROC")

    def release(self, handle) -> None:
        self.released.append(handle)


# -- transfers in flight ------------------------------------------------------------------------------


def test_inflight_fences_pages_until_nixl_says_the_transfer_ended(caplog):
    agent = FakeAgent()
    f = InFlight(agent, "test", stuck_s=5.0)
    f.post("h1", [3, 4], 100, key="a", t0=0.0)
    f.post("h2", [4], 100, key="b", t0=0.0)
    assert f.fenced() == {3, 4} and len(f) == 2 and [x.handle for x in f.of("b")] == ["h2"]
    assert f.reap(now=1.0) == [] and not caplog.records
    agent.states["h1"] = "DONE"
    with caplog.at_level(logging.WARNING, "trnd.transfer"):
        ended = f.reap(now=6.0)
        f.reap(now=7.0)
    assert [(x.handle, ok) for x, ok in ended] == [("h1", True)] and agent.released == ["h1"]
    assert f.fenced() == {4}  # page 4 is still read by h2
    assert [r.message for r in caplog.records] == ["a test transfer has run for 5 s; its 1 pages stay fenced"]
    agent.states["h2"] = "ERR"
    assert [(x.key, ok) for x, ok in f.reap()] == [("b", False)] and f.fenced() == set() and not f


# -- prefill: Shipped ---------------------------------------------------------------------------------


def test_shipped_sends_whole_pages_while_prefilling_and_the_tail_at_the_end():
    led, f = Shipped(), InFlight(FakeAgent(), "test")
    s = led.add("p1/a", "a", peer=1, skip_pages=1, dst_pages=[10, 11, 12])
    assert s.pages_ready(20, 40, 16, pipeline=True) == range(1, 1)  # page 1 not complete yet
    got = s.pages_ready(33, 40, 16, pipeline=True)
    assert got == range(1, 2)
    assert s.next_notif() == b"a|1"
    s.posted(got, f.post("h1", [5], 100, key="p1/a"))
    assert s.pages_ready(33, 40, 16, pipeline=True) == range(0)  # nothing new
    assert s.pages_ready(40, 40, 16, pipeline=False) == range(2, 3)  # the partial last page too
    assert s.pages_ready(33, 40, 16, pipeline=False) == range(0)  # no pipelining: only at the end
    assert s.abort() and not s.abort()  # aborted once
    assert s.pages_ready(40, 40, 16, pipeline=True) == range(0)


def test_shipped_holds_until_every_write_ends_then_answers_aborted_once():
    agent = FakeAgent()
    led, f = Shipped(), InFlight(agent, "test")
    s = led.add("p1/a", "a", peer=1, skip_pages=0, dst_pages=[10, 11], expires=100.0)
    s.posted(range(0, 1), f.post("h1", [5], 100, key="p1/a"))
    s.posted(range(1, 2), f.post("h2", [6], 100, key="p1/a"))
    assert f.fenced() == {5, 6} and s.expired(100.0) and not s.expired(99.0)
    s.abort()
    assert led.settle("p1/a") is None  # writes still reading pages 5 and 6
    agent.states.update(h1="DONE")
    for x, ok in f.reap():
        led.get(x.key).ended(x)
    assert led.settle("p1/a") is None and f.fenced() == {6}
    agent.states.update(h2="ERR")
    for x, ok in f.reap():
        led.get(x.key).ended(x)
    assert led.settle("p1/a") == "aborted" and len(led) == 0
    assert led.settle("p1/a") is None  # forgotten: Aborted is said once


def test_shipped_done_is_forgotten_and_peers_are_found():
    led = Shipped()
    a = led.add("p1/a", "a", 1, 0, [1])
    led.add("p2/b", "b", 2, 0, [2])
    assert led.of_peer(2) == ["p2/b"] and led.peers() == {1, 2}
    assert led.settle("p1/a") is None  # neither done nor aborted
    a.finish()
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
    assert led.cut == {} and led.overdue(13.0, lambda peer: True, 2.0) == []
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


def test_awaited_overdue_cuts_a_connected_peers_pages_and_quarantines_an_unreachable_ones():
    led = Awaited()
    led.expect("a", "up", [4], 0.0, deadline=5.0)
    led.expect("b", "down", [5, 6], 0.0, deadline=5.0)
    led.expect("c", "up", [7], 0.0, deadline=9.0)
    late = led.overdue(5.0, lambda peer: peer == "up", fence_s=2.0)
    assert [(a.rid, ask) for a, ask in late] == [("a", True), ("b", False)]
    assert all(a.over == "timeout" for a, _ in late)
    assert led.cut == {"a": ("up", [4])} and led.quarantined_pages() == 3
    assert led.expire(6.9) == [] and led.expire(7.0) == [[5, 6]]
    assert led.settled("a") == [4] and led.settled("a") is None  # the peer's word frees the cut pages once


# -- decode's Inbox under the real scheduler ----------------------------------------------------------

class Decode:
    """What roles/decode.py gives the Inbox: an engine (its pool holds) and a link to one peer "p"."""

    def __init__(self, num_pages=16, retries=1, timeout_s=60.0):
        self.pool = PagePool(num_pages)
        self.radix = RadixCache(self.pool, 4)
        self.scheduler = Scheduler(SchedulerConfig(page_size=4, token_budget=64, chunk_size=64), self.pool, self.radix)
        self.held: list[list[int]] = []
        self.sent: list[tuple[str, object]] = []
        self.up = True
        engine = SimpleNamespace(xfer_metrics=TransferMetrics(), runner=SimpleNamespace(page_bytes=64),
                                 tp=SimpleNamespace(size=1), has_work=False, hold=self.hold, drop=self.drop)
        link = PeerLink(connected=lambda peer: self.up, send=lambda peer, msg: self.sent.append((peer, msg)),
                        can_retry=lambda: self.up)
        self.inbox = Inbox(engine, link, fence_s=5.0, retries=retries, timeout_s=timeout_s)
        self.scheduler.peer = lambda req: self.inbox.expect(req, "p", req.num_cached // 4)

    def hold(self, pages):
        self.pool.ref(pages)
        self.held.append(list(pages))

    def drop(self, pages):
        self.pool.unref(pages)
        self.held.remove(list(pages))

    def check(self):
        check_pool_integrity(self.pool, self.radix, self.scheduler.owner_lists() + self.held)

    def done(self, rid, token=7):
        self.inbox.kv_done(wire.KVDone(rid, token, None, None, num_xfers=1, computed_tokens=10))
        self.inbox.poll({"agent": [f"{rid}|1".encode()]})


def request(d: Decode) -> Req:
    r = Req(list(range(10)), SamplingParams(max_tokens=4))
    d.scheduler.add(r)
    return r


def test_a_peer_request_parks_with_every_prompt_page_then_decodes():
    d = Decode()
    s = d.scheduler
    r = request(d)
    b = s.schedule()
    assert b.empty and r.rid in s.parked and len(r.pages) == 3 and s.has_work
    assert s.find(r.rid) is r
    [(peer, msg)] = d.sent
    assert peer == "p" and isinstance(msg, wire.PrefillReq) and msg.dst_pages == r.pages
    d.check()
    d.inbox.kv_done(wire.KVDone(r.rid, 7, None, None, num_xfers=1, computed_tokens=10))
    assert s.schedule().arrived == []  # the write's notification is not in yet
    d.inbox.poll({"agent": [f"{r.rid}|1".encode()]})
    b = s.schedule()
    assert [q for q, _ in b.arrived] == [r] and b.arrived[0][1].first.token == 7
    assert r.num_computed == 10 and r in s.running and not s.parked
    assert b.decode == []  # its first token is delivered; it decodes from the next step
    assert d.inbox.stats["kv_pages_received"] == 3


def test_an_aborted_peer_request_keeps_its_pages_until_the_peer_confirms():
    d = Decode()
    s, pool = d.scheduler, d.pool
    r = request(d)
    s.schedule()
    s.finish(r, "abort")
    assert s.find(r.rid) is None and pool.num_free == 13  # fenced: still held
    assert isinstance(d.sent[-1][1], wire.Abort) and d.inbox.stats["fenced"] == 1
    s.schedule()
    assert pool.num_free == 13
    d.inbox.aborted(r.rid)
    s.schedule()
    assert pool.num_free == 16 and not s.parked and not s.has_work


def test_a_lost_peer_retries_once_then_fails_and_quarantined_pages_stay_held():
    d = Decode()
    s, pool = d.scheduler, d.pool
    r = request(d)
    s.schedule()
    d.inbox.peer_lost("p")  # its target pages rest in quarantine, held
    b = s.schedule()  # retried: released, back in the queue, then admitted again and parked on a new ask
    assert r.rid in s.parked and r.handoffs == 2 and not b.failed and d.inbox.stats["retried"] == 1
    d.check()
    d.inbox.peer_lost("p")
    b = s.schedule()
    assert [(q, str(e)) for q, e in b.failed] == [(r, "prefill server p was lost during the request")]
    assert r.status is Status.FINISHED
    d.check()
    d.inbox.handshaked("p")  # the peer is back: its earlier session is over
    assert pool.num_free == 16 and d.held == []


def test_a_prefill_failure_fails_the_request_and_frees_its_pages():
    d = Decode()
    r = request(d)
    d.scheduler.schedule()
    d.inbox.failed(r.rid, "bad prompt")
    b = d.scheduler.schedule()
    assert [str(e) for _, e in b.failed] == ["prefill failed: bad prompt"] and d.pool.num_free == 16


def test_a_handoff_past_its_deadline_fails_and_its_pages_wait_for_the_peers_word():
    """Connected peer: asked to abort, the pages held until it answers. Unreachable peer: the pages rest
    fence_s in quarantine (what it posted may still land), then are freed."""
    import time

    d = Decode(timeout_s=0.001)
    s = d.scheduler
    r = request(d)
    s.schedule()
    pages = list(r.pages)
    time.sleep(0.01)
    d.inbox.poll({})
    b = s.schedule()
    assert [type(e).__name__ for _, e in b.failed] == ["DeadlineExceeded"] and d.inbox.stats["timed_out"] == 1
    assert isinstance(d.sent[-1][1], wire.Abort) and d.held == [pages]
    d.inbox.aborted(r.rid)  # the peer's word
    assert d.held == [] and d.pool.num_free == 16
    d.up, d.inbox.fence_s = False, 0.0
    r2 = request(d)
    s.schedule()
    time.sleep(0.01)
    d.inbox.poll({})  # past the deadline, the peer unreachable: quarantined for fence_s (0 here), then freed
    s.schedule()
    d.inbox.poll({})
    assert d.held == [] and d.pool.num_free == 16 and r2.status is Status.FINISHED
    d.check()


def test_awaited_is_landing_only_while_a_done_handoffs_notifications_are_due():
    """What the decode loop polls fast for: a KVDone in, its writes' notifications not all yet. A handoff
    still computing on its peer is not polled for (the KVDone's arrival wakes the loop)."""
    led = Awaited()
    led.expect("a", "p", [4, 5], 0.0)
    assert not led.landing()  # computing on the peer
    led.kv_done("a", SimpleNamespace(num_xfers=2))
    assert led.landing()
    led.notified("a")
    assert led.landing()
    led.notified("a")
    assert not led.landing() and led.landed("a")
