"""The decode server's side of the KV handoff, as one component: the requests whose prompt KV a prefill
peer is writing into this server's pool, what happens when each one ends, and the pages a write may
still reach.

`Inbox` keeps the `Awaited` ledger (transfer/handoff.py) and the policy around it: a landed handoff
becomes the request's first token; a lost peer means retry on another peer (up to prefill_retries) or
fail; a failed one fails; one past handoff_timeout_s fails with 504 while its pages stay held until the
peer's word, or rest fence_s in quarantine when the peer is not connected; an engine abort fences the
pages until the peer confirms nothing is in flight. `FromPrefill` is the scheduler's parked job
(engine/parked.py) and asks only the Inbox. The Inbox reaches the connections through `PeerLink`, the
three things the DecodeServer (roles/decode.py) tells it: whether a peer is connected, a message to a
peer, whether another peer could take a retry. Everything here runs on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from trnd import snapshot as S
from trnd.engine import trace
from trnd.engine.loop import DeadlineExceeded, Unavailable
from trnd.engine.parked import Landing, Parked
from trnd.engine.request import Req
from trnd.engine.sampler import SampleOut
from trnd.transfer import protocol as wire
from trnd.transfer.handoff import Awaited, Awaiting

log = logging.getLogger("trnd.decode")


@dataclass
class PeerLink:
    """What the Inbox may ask of the decode server and its connections (all from the engine thread)."""
    connected: Callable[[str], bool]  # is the peer at this address connected now?
    send: Callable[[str, object], None]  # queue a control message to it
    can_retry: Callable[[], bool]  # is any peer healthy to take a retry?
    verify: Callable[[Req, Awaiting], str | None] = lambda req, a: None  # what landed vs the peer's digest
    observe: Callable[[Awaiting, int], None] = lambda a, nbytes: None  # a landed handoff's pace (its link)


class FromPrefill(Parked):
    """A request parked in the scheduler while a prefill peer writes its prompt's KV (engine/parked.py)."""
    phase = "waiting_for_kv"

    def __init__(self, inbox: "Inbox", req: Req, error: BaseException | None = None):
        super().__init__(req)
        self.inbox, self.error = inbox, error

    def done(self) -> bool:
        return self.error is not None or self.inbox.awaited.ended(self.req.rid)

    def abort(self) -> None:
        super().abort()
        if self.error is None:
            self.inbox.fence(self.req.rid)

    def result(self) -> Landing:
        return self.inbox.landing(self)


def peer_hits(peer: dict[str, int], ours: int) -> dict[str, int]:
    """The part of a prefill peer's cache hits (device, then host, then remote, along the prompt) that lies
    beyond the `ours` prompt tokens this server held itself: what the peer adds to cached_tokens (its
    device hits count as "prefill"). Both are prefixes of one prompt, so cached_tokens is the longer one."""
    out, pos = {}, 0
    for src in ("device", "host", "remote"):
        n = peer.get(src, 0)
        if pos + n > max(pos, ours):
            out["prefill" if src == "device" else src] = pos + n - max(pos, ours)
        pos += n
    return out


class Inbox:
    def __init__(self, engine, link: PeerLink, *, fence_s: float, retries: int, timeout_s: float):
        self.engine, self.link = engine, link
        self.fence_s, self.retries, self.timeout_s = fence_s, retries, timeout_s
        self.awaited = Awaited()
        self.xfer_metrics = engine.xfer_metrics  # per prefill peer: op kv_receive (handoff sent -> KV landed)
        self.stats = {"handoffs": 0, "retried": 0, "failed": 0, "fenced": 0, "timed_out": 0,
                      "kv_pages_received": 0, "kv_bytes_received": 0, "digest_failures": 0}

    # -- the scheduler's side -----------------------------------------------------------------------

    def expect(self, req: Req, peer: str, skip: int) -> FromPrefill:
        """Hand `req` to `peer`: its prompt pages from `skip` on are the target (the first `skip` are this
        server's own prefix-cache hit)."""
        req.handoffs += 1
        now = time.monotonic()
        self.awaited.expect(req.rid, peer, req.pages[skip:], now, now + self.timeout_s)
        self.stats["handoffs"] += 1
        self.xfer_metrics.start("kv_receive", peer, key=req.rid)
        self.link.send(peer, wire.PrefillReq(req.rid, req.prompt_ids, req.params, skip, req.pages[skip:],
                                             expires=time.time() + self.timeout_s, session=req.session_id))
        trace.phase(req, f"handed to prefill {peer}: {req.num_prompt - req.num_cached} tokens to write, "
                         f"{req.num_cached} held here")
        return FromPrefill(self, req)

    def landing(self, job: FromPrefill) -> Landing:
        """What the scheduler does with a request whose peer is done with it."""
        req = job.req
        if job.error is not None:
            return Landing(error=job.error)
        a = self.awaited.forget(req.rid)
        if a is None or job.aborted or a.over == "aborted":
            self.xfer_metrics.end("kv_receive", ok=None, key=req.rid)
            return Landing()  # released by the scheduler: nothing can land any more
        ok = a.over is None
        bad = ok and self.link.verify(req, a)
        if bad:
            ok = False
            self.stats["digest_failures"] += 1
            log.error("handoff of %s from %s: %s", req.rid, a.peer, bad)
            trace.phase(req, f"KV digest failed: {bad}")
        nbytes = len(a.target) * self.engine.runner.page_bytes
        self.xfer_metrics.end("kv_receive", nbytes=nbytes * self.engine.tp.size if ok else 0, ok=ok, key=req.rid)
        if ok:
            m = a.done
            self.link.observe(a, nbytes * self.engine.tp.size)
            trace.phase(req, f"KV received from {a.peer}: {req.num_prompt - req.num_cached} tokens written, "
                             f"{m.computed_tokens} computed there, its cache hits {m.cached_from}")
            self.stats["kv_pages_received"] += len(a.target)
            self.stats["kv_bytes_received"] += nbytes
            return Landing(first=SampleOut(m.token, m.logprob, m.top_logprobs), computed_tokens=m.computed_tokens,
                           cached_from=peer_hits(m.cached_from, req.num_cached),
                           received=req.num_prompt - req.num_cached)
        if bad:  # every write landed (nothing in flight): the pages are free to take again
            if req.handoffs <= self.retries:
                self.stats["retried"] += 1
                return Landing(retry=True)
            self.stats["failed"] += 1
            return Landing(error=Unavailable(f"prefill {a.peer}: {bad}"))
        if a.over == "lost":  # its target pages are in quarantine (held); retry elsewhere or fail
            if req.handoffs <= self.retries and self.link.can_retry():
                self.stats["retried"] += 1
                return Landing(retry=True)
            self.stats["failed"] += 1
            return Landing(error=Unavailable(f"prefill server {a.peer} was lost during the request"))
        self.stats["failed"] += 1
        if a.over == "timeout":
            return Landing(error=DeadlineExceeded(a.reason))
        return Landing(error=Unavailable(f"prefill failed: {a.reason}"))

    def fence(self, rid: str) -> None:
        """Engine abort of a parked request: keep its pages until the peer confirms nothing is in flight."""
        a = self.awaited.entries.get(rid)
        if a is not None and self.awaited.fence(rid, connected=self.link.connected(a.peer)):
            self.stats["fenced"] += 1
            self.link.send(a.peer, wire.Abort(rid))

    # -- what the peer says (the server's asyncio side hands it over through the engine loop) -------

    def kv_done(self, m: wire.KVDone) -> None:
        self.awaited.kv_done(m.rid, m)

    def aborted(self, rid: str) -> None:
        if not self._settled(rid):
            self.awaited.aborted(rid)

    def failed(self, rid: str, reason: str) -> None:
        if not self._settled(rid):
            self.awaited.failed(rid, reason, time.monotonic())

    def _settled(self, rid: str) -> bool:
        """The peer's word on a timed-out handoff: no write can land any more, free its pages."""
        pages = self.awaited.settled(rid)
        if pages is not None:
            self.engine.drop(pages)
        return pages is not None

    def peer_lost(self, peer: str) -> None:
        """Everything sent to it: target pages rest in quarantine (a write could still be on the wire);
        the scheduler then releases the rest and retries each request on another peer or fails it."""
        for a in self.awaited.peer_lost(peer, time.monotonic(), self.fence_s):
            self.engine.hold(a.target)

    def handshaked(self, peer: str) -> None:
        """A Welcome means the peer's earlier session is over (prefill settles it before answering; a new
        process means the old one is gone): its quarantined pages are free again."""
        for pages in self.awaited.release(peer):
            self.engine.drop(pages)

    # -- every engine-loop turn ---------------------------------------------------------------------

    def poll(self, notifs: dict[str, list[bytes]]) -> bool:
        """Count the chunk writes that landed, time out stalled handoffs, free expired quarantine. True
        while worth polling again at once."""
        for msgs in notifs.values():
            for m in msgs:
                rid, _, _ = m.decode(errors="replace").rpartition("|")
                self.awaited.notified(rid, time.monotonic())
        now = time.monotonic()
        for a, ask in self.awaited.overdue(now, self.link.connected, self.fence_s):
            log.warning("handoff of %s: %s", a.rid, a.reason)  # failed now; its pages held until the peer's word
            self.stats["timed_out"] += 1
            self.engine.hold(a.target)
            if ask:
                self.link.send(a.peer, wire.Abort(a.rid))
        if self.awaited.quarantine:
            for pages in self.awaited.expire(now):
                self.engine.drop(pages)
        # Busy (poll again within the ms) while a landing's notifications are due, or while only fences and
        # quarantines are left (no engine work); a handoff still computing on its peer ends with a KVDone,
        # whose arrival wakes the loop (EngineLoop.call), so it needs no polling.
        return self.awaited.landing() or (bool(self.awaited) and not self.engine.has_work)

    # -- inspection ---------------------------------------------------------------------------------

    def outstanding(self, peer: str) -> int:
        return self.awaited.outstanding(peer)

    def transfers(self, now: float, **extra) -> S.Transfers:
        return S.Transfers(in_flight=[S.InFlight(rid=rid, peer=a.peer, notifs=a.notifs, fenced=a.fenced,
                                                 age_s=round(now - a.sent_at, 3))
                                      for rid, a in self.awaited.entries.items()],
                           quarantined_pages=self.awaited.quarantined_pages(), **self.stats, **extra)

