"""The KV handoff's books, one per side, as plain ledgers keyed by request id and peer id.

Prefill's `Shipped`: for each request it prefills for a decode peer, which of the prompt's pages were
written so far and which NIXL writes are still reading its source pages (transfer/inflight.py: held until
they end, whatever happens to the request). Decode's `Awaited`: for each request whose prompt KV a peer is writing, the
chunk notifications and the KVDone seen, whether it is fenced (aborted here, but a write may still
land: wait for the peer's word), and the quarantine of pages a lost peer may still write into.

No sockets, no engine, no clock of their own: prefill (roles/prefill.py) and decode's Inbox
(roles/inbox.py) feed them what arrives and act on what they answer; tests/unit/test_handoff.py drives them alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trnd.transfer.inflight import Xfer

# -- prefill: what was shipped ---------------------------------------------------------------------------


@dataclass
class Shipment:
    """One request's KV on its way to a decode peer. Its flags change through its methods."""
    rid: str  # the decode server's request id
    peer: int  # decode peer id
    skip_pages: int  # leading prompt pages decode already holds (its prefix cache): not sent
    dst_pages: list[int]  # decode's pages for prompt pages skip_pages.. (one each)
    sent_pages: int  # prompt page index up to which writes were issued
    expires: float = 0.0  # decode's wall clock: no write is posted after it (protocol.PrefillReq)
    num_xfers: int = 0  # writes posted (KVDone tells decode how many notifications to wait for)
    xfers: list[Xfer] = field(default_factory=list)  # in flight (transfer/inflight.py)
    done: bool = False  # first token sampled and KVDone sent
    aborted: bool = False
    hasher: object = None  # the digest of every byte written so far (transfer/digest.py)
    descriptors: int = 0  # NIXL descriptors posted, after coalescing
    t_start: float = 0.0  # when prefill took the request (KVDone.prefill_s)

    def pages_ready(self, computed: int, num_prompt: int, page_size: int, pipeline: bool) -> range:
        """Prompt pages that `computed` tokens completed and that were not written yet: whole pages
        while the prompt is still prefilling (only with pipelining), every page once it is done."""
        if self.aborted or (computed < num_prompt and not pipeline):
            return range(0)
        upto = -(-computed // page_size) if computed >= num_prompt else computed // page_size
        return range(self.sent_pages, max(self.sent_pages, upto))

    def next_notif(self) -> bytes:
        """The notification the next write carries (decode counts them per rid)."""
        self.num_xfers += 1
        return f"{self.rid}|{self.num_xfers}".encode()

    def posted(self, pages: range, xfer: Xfer, descriptors: int = 1) -> None:
        self.xfers.append(xfer)
        self.sent_pages = pages.stop
        self.descriptors += descriptors

    def ended(self, xfer: Xfer) -> None:
        self.xfers.remove(xfer)

    def expired(self, wall_now: float) -> bool:
        return bool(self.expires) and wall_now >= self.expires

    def abort(self) -> bool:
        """No more writes for it; False when it was aborted already."""
        was, self.aborted = self.aborted, True
        return not was

    def finish(self) -> None:
        """KVDone went out."""
        self.done = True


class Shipped:
    def __init__(self):
        self.by_local: dict[str, Shipment] = {}  # prefill's local request id -> shipment

    def __len__(self) -> int:
        return len(self.by_local)

    def get(self, local: str) -> Shipment | None:
        return self.by_local.get(local)

    def add(self, local: str, rid: str, peer: int, skip_pages: int, dst_pages: list[int],
            expires: float = 0.0, started: float = 0.0) -> Shipment:
        s = self.by_local[local] = Shipment(rid, peer, skip_pages, dst_pages, skip_pages, expires, t_start=started)
        return s

    def settle(self, local: str) -> str | None:
        """Forget a shipment with nothing in flight that is over. "aborted": tell the peer `Aborted`
        (no write can land any more); "done": KVDone went out already. None: keep it."""
        s = self.by_local.get(local)
        if s is None or s.xfers:
            return None
        if s.aborted:
            del self.by_local[local]
            return "aborted"
        if s.done:
            del self.by_local[local]
            return "done"
        return None

    def of_peer(self, peer: int) -> list[str]:
        return [local for local, s in self.by_local.items() if s.peer == peer]

    def peers(self) -> set[int]:
        """Decode peers something is still shipped to (engine thread: asyncio asks through the loop)."""
        return {s.peer for s in self.by_local.values()}


# -- decode: what is awaited -----------------------------------------------------------------------------


@dataclass
class Awaiting:
    """One request whose prompt KV a prefill peer is writing into `target` (decode's pages)."""
    rid: str
    peer: str  # prefill peer id (its address)
    target: list[int]
    sent_at: float
    notifs: int = 0  # chunk writes that landed (NIXL notifications)
    first_notif: float = 0.0  # when the first and the latest of them were seen (the link's pace: transfer/linkrate.py)
    last_notif: float = 0.0
    done: object = None  # transfer/protocol.py KVDone: the first token and how many writes to expect
    deadline: float = 0.0  # the handoff must have landed by then (0: none); no write is posted after it
    fenced: bool = False  # aborted here while a write may land: wait for the peer's Aborted
    over: str | None = None  # ended without KV: "aborted" (nothing in flight), "lost" (peer gone), "failed",
    #                          "timeout" (missed its deadline: its pages are `cut`, held until the peer's word)
    reason: str = ""


class Awaited:
    def __init__(self):
        self.entries: dict[str, Awaiting] = {}
        self.quarantine: list[tuple[float, list[int], str]] = []  # (until, pages, peer) a lost peer may still write
        self.cut: dict[str, tuple[str, list[int]]] = {}  # timed out: rid -> (peer, pages) until the peer's word

    def __len__(self) -> int:
        return len(self.entries)

    def expect(self, rid: str, peer: str, target: list[int], now: float, deadline: float = 0.0) -> Awaiting:
        a = self.entries[rid] = Awaiting(rid, peer, target, now, deadline=deadline)
        return a

    def notified(self, rid: str, now: float = 0.0) -> None:
        a = self.entries.get(rid)
        if a is not None:
            a.notifs += 1
            a.first_notif = a.first_notif or now
            a.last_notif = now

    def kv_done(self, rid: str, msg) -> None:
        a = self.entries.get(rid)
        if a is not None:
            a.done = msg

    def landing(self) -> bool:
        """Some KVDone is in and its writes' notifications are still coming: worth polling for now."""
        return any(a.done is not None and a.over is None and a.notifs < a.done.num_xfers
                   for a in self.entries.values())

    def landed(self, rid: str) -> bool:
        """KVDone and every write's notification are in, and nobody aborted it."""
        a = self.entries.get(rid)
        return (a is not None and a.over is None and not a.fenced and a.done is not None
                and a.notifs >= a.done.num_xfers)

    def ended(self, rid: str) -> bool:
        a = self.entries.get(rid)
        return a is None or a.over is not None or self.landed(rid)

    def fence(self, rid: str, connected: bool) -> bool:
        """Aborted here. True: ask the peer to abort and wait for its word; False: nothing can be in
        flight (the peer is not connected), it is over now."""
        a = self.entries.get(rid)
        if a is None or a.over is not None:
            return False
        if not connected:
            a.over = "aborted"
            return False
        a.fenced = True
        return True

    def overdue(self, now: float, connected: Callable[[str], bool], fence_s: float) -> list[tuple[Awaiting, bool]]:
        """Handoffs past their deadline: over ("timeout"); the caller holds their target pages. A connected
        peer's are cut until its word (True: ask it to abort); a peer not connected can post nothing new,
        and what it posted lands within fence_s: quarantined (False)."""
        late = [a for a in self.entries.values() if a.over is None and not a.fenced and a.deadline and now >= a.deadline]
        out = []
        for a in late:
            a.over, a.reason = "timeout", self._late(a)
            ask = connected(a.peer)
            if ask:
                self.cut[a.rid] = (a.peer, a.target)
            else:
                self.quarantine.append((now + fence_s, a.target, a.peer))
            out.append((a, ask))
        return out

    @staticmethod
    def _late(a: Awaiting) -> str:
        return f"prefill {a.peer} did not deliver the KV within {a.deadline - a.sent_at:g} s"

    def settled(self, rid: str) -> list[int] | None:
        """The peer's word (Aborted or PrefillFailed) on a timed-out handoff: its cut pages, to free."""
        got = self.cut.pop(rid, None)
        return got[1] if got is not None else None

    def aborted(self, rid: str) -> None:
        """The peer confirmed: nothing of it is in flight."""
        a = self.entries.get(rid)
        if a is not None and a.over is None:
            a.over = "aborted"

    def failed(self, rid: str, reason: str, now: float = 0.0) -> None:
        """The peer gave up on it (and has nothing in flight for it). Past the handoff's deadline it is this
        side's timeout, whichever side noticed first (the peer posts nothing after it either)."""
        a = self.entries.get(rid)
        if a is None or a.over is not None:
            return
        if a.fenced:
            a.over, a.reason = "aborted", ""
        elif a.deadline and now >= a.deadline:
            a.over, a.reason = "timeout", self._late(a)
        else:
            a.over, a.reason = "failed", reason

    def peer_lost(self, peer: str, now: float, fence_s: float) -> list[Awaiting]:
        """Everything sent to it is over; its target pages rest in quarantine for fence_s (a write
        could still be on the wire). Returns those entries (their pages: the caller holds them)."""
        lost = [a for a in self.entries.values() if a.peer == peer and a.over is None]
        for a in lost:
            a.over = "lost"
            if a.target:  # a stopped peer posts nothing after the deadline; what it posted before lands by +fence_s
                self.quarantine.append((max(now, a.deadline) + fence_s, a.target, peer))
        for rid, (p, pages) in list(self.cut.items()):
            if p == peer:  # already held by the caller since the timeout
                del self.cut[rid]
                self.quarantine.append((now + fence_s, pages, peer))
        return lost

    def release(self, peer: str) -> list[list[int]]:
        """The peer handshaked again: its earlier session is over (prefill sends Welcome only once the
        old one's writes have all ended, and a new process means the old one is gone)."""
        out = [pages for _, pages, p in self.quarantine if p == peer]
        self.quarantine = [q for q in self.quarantine if q[2] != peer]
        return out

    def expire(self, now: float) -> list[list[int]]:
        """Quarantined page lists whose time is up (the caller frees them)."""
        out = [pages for until, pages, _ in self.quarantine if until <= now]
        self.quarantine = [q for q in self.quarantine if q[0] > now]
        return out

    def forget(self, rid: str) -> Awaiting | None:
        return self.entries.pop(rid, None)

    def outstanding(self, peer: str) -> int:
        return sum(1 for a in self.entries.values() if a.peer == peer and a.over is None)

    def quarantined_pages(self) -> int:
        return (sum(len(pages) for _, pages, _ in self.quarantine)
                + sum(len(pages) for _, pages in self.cut.values()))
