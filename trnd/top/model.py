"""Plain data derived from `/admin/state` snapshots: what the panels and `--once` print.

Nothing here reads a clock or touches the network. Rates come from two successive snapshots of the
same process, timed by its own `uptime_s`, so a recorded pair of states renders the same every time;
the only local time is `now`, passed in by the caller (the app injects its clock), used for
"unreachable for 12 s".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import msgspec

from trnd import snapshot as S
from trnd.top.fmt import fmt_duration

HISTORY = 40  # samples per sparkline

STATE_LABELS = {"waiting": "waiting", "loading_kv": "loading KV", "waiting_for_kv": "waiting KV",
                "prefilling": "prefilling", "decoding": "decoding"}


@dataclass
class Poll:
    """One poll of a target: its /admin/state (None when it failed) and what /ready said."""
    state: S.State | None  # a decoded JSON object is decoded into the schema here
    ready: str | None = None  # /ready's "status": ready | loading | draining; None if not known
    kind: str = "ok"  # ok | unreachable (refused, reset, DNS) | slow (no answer in time) | error (HTTP status)
    error: str | None = None

    def __post_init__(self):
        if isinstance(self.state, dict):
            self.state = S.decode(self.state)


@dataclass
class ReqRow:
    node: str
    id: str
    session: str | None
    state: str  # a STATE_LABELS value
    prompt: int
    cached: int
    computed: int
    generated: int
    max_tokens: int
    pages: int
    tokens_per_s: float | None
    age_s: float
    preemptions: int
    queued: bool  # in the waiting queue, not the running batch

    @property
    def key(self) -> str:
        return row_key(self.node, self.id)

    def text(self) -> str:
        """What `/` filters on."""
        return f"{self.node} {self.id} {self.session or ''} {self.state}".lower()


@dataclass
class Tier:
    """Pages of one cache tier: device (the KV pool), host L2, remote L3."""
    name: str
    total: int
    in_use: int
    cached: int
    free: int
    page_bytes: int | None = None
    evict_per_s: float | None = None
    load_per_s: float | None = None
    store_per_s: float | None = None
    hit_rate: float | None = None  # lookups that found the page in this tier
    note: str = ""  # e.g. the L3 stores behind a client's remote tier, whose page counts only they know
    usage_known: bool = True


@dataclass
class PeerView:
    node: str
    peer: str
    kind: str
    healthy: bool | None
    history: list[float]  # bytes/s, oldest first
    rate: float | None  # latest bytes/s
    total_bytes: int | None
    note: str  # requests, outstanding, errors


@dataclass
class InFlight:
    node: str
    rid: str
    peer: str
    detail: str
    age_s: float


def row_key(node: str, rid: str) -> str:
    return f"{node}\t{rid}"


class NodeTrack:
    """One target over time: the latest poll, the previous good state, derived rates and histories."""

    def __init__(self, name: str):
        self.name = name
        self.poll: Poll | None = None
        self.state: S.State | None = None  # latest good /admin/state
        self.prev: S.State | None = None  # the one before, same process
        self.last: S.State | None = None  # latest good state, kept while the target is down
        self.known: dict = {}  # role, model, point, tp: kept while the target is down
        self.down_since: float | None = None
        self.rates: dict[str, float | None] = {}
        self.hit_window: float | None = None
        self.peer_hist: dict[str, deque[float]] = {}
        self.peer_rate: dict[str, float | None] = {}
        self.tier_rates: dict[str, tuple[float | None, ...]] = {}  # evict, load, store per second

    # -- updates -----------------------------------------------------------------------------------

    def update(self, poll: Poll, now: float) -> None:
        self.poll = poll
        st = poll.state
        if st is None:
            if self.down_since is None:
                self.down_since = now
            if poll.kind != "slow":  # a slow answer may still come: keep showing the last state meanwhile
                self.state = None
            return
        self.down_since = None
        prev = self.last
        if prev is not None and (st.uptime_s or 0) <= (prev.uptime_s or 0):
            prev = None  # restarted (or the same snapshot twice): no rates across processes
            self.peer_hist.clear()
        self.prev, self.state, self.last = prev, st, st
        self.known = {"role": st.role, "model": st.model or "-", "point": st.point,
                      "tp": st.layout.tp if st.layout else None}
        self._derive(prev, st)

    def _derive(self, prev: S.State | None, st: S.State) -> None:
        dt = ((st.uptime_s or 0) - (prev.uptime_s or 0)) if prev is not None else 0.0

        def rate(a: float | None, b: float | None) -> float | None:
            if prev is None or dt <= 0 or a is None or b is None:
                return None
            return max(0.0, (b - a) / dt)

        s0, s1 = prev.stats if prev is not None else None, st.stats
        r0, r1 = (prev.radix if prev is not None else None) or S.Radix(), st.radix or S.Radix()
        self.rates = {"gen": rate(s0 and s0.generation_tokens, s1 and s1.generation_tokens),
                      "prefill": rate(s0 and s0.prefill_tokens, s1 and s1.prefill_tokens),
                      "evict": rate(r0.evicted_pages if st.radix else None, r1.evicted_pages if st.radix else None),
                      "xfer": rate(_xfer_bytes(prev) if prev else None, _xfer_bytes(st))}
        dq = r1.query_tokens - r0.query_tokens
        self.hit_window = (r1.hit_tokens - r0.hit_tokens) / dq if prev and dq > 0 else None
        t0 = {t.name: t for t in _raw_tiers(prev)} if prev else {}
        self.tier_rates = {}
        for t in _raw_tiers(st):
            old = t0.get(t.name)
            self.tier_rates[t.name] = (rate(old.evicted, t.evicted) if old else None,
                                       rate(old.loaded, t.loaded) if old else None,
                                       rate(old.stored, t.stored) if old else None)
        # transfer throughput: per peer where the role counts bytes per peer, plus the node's total
        def byte_counts(state: S.State | None) -> dict[str, int | None]:
            if state is None:
                return {}
            return {**{_peer_id(p): p.bytes_sent for p in state.peers or []}, "(all)": _xfer_bytes(state)}

        before = byte_counts(prev)
        self.peer_rate = {}
        for pid, b in byte_counts(st).items():
            if b is None:
                continue
            r = self.peer_rate[pid] = rate(before.get(pid), b)
            if r is not None:
                self.peer_hist.setdefault(pid, deque(maxlen=HISTORY)).append(r)

    # -- views -------------------------------------------------------------------------------------

    @property
    def role(self) -> str:
        return self.known.get("role", "?")

    @property
    def status(self) -> str:
        """loading | ready | draining | degraded (a TP rank down) | unreachable | slow | error | polling."""
        p = self.poll
        if p is None:
            return "polling"
        if p.state is None:
            return p.kind if p.kind in ("unreachable", "slow") else "error"
        if p.state.draining or p.ready == "draining":
            return "draining"
        if p.ready == "loading":
            return "loading"
        if any(not r.alive for r in _ranks(p.state)):
            return "degraded"
        if p.state.integrity is not None and not p.state.integrity.ok:
            return "degraded"
        return "ready"

    def note(self, now: float) -> str:
        """Why a node is not plainly ready, in a few words."""
        p = self.poll
        if p is None:
            return ""
        if p.state is None:
            gone = now - self.down_since if self.down_since is not None else 0.0
            since = f" for {fmt_duration(gone)}" if gone >= 1 else ""
            return f"{p.error or p.kind}{since}"
        down = [str(r.rank) for r in _ranks(p.state) if not r.alive]
        if down:
            return f"rank {', '.join(down)} down"
        bad = [_peer_id(q) for q in p.state.peers or [] if q.healthy is False]
        if bad:
            return f"peer {', '.join(bad)} unhealthy"
        if p.state.integrity is not None and not p.state.integrity.ok:
            return f"page pool check failed: {p.state.integrity.error}"
        if p.state.kernels is not None and p.state.kernels.slow_path:
            return "no compiled CPU kernels: torch ops"
        return ""

    def step_ms(self) -> float | None:
        if self.state is None:
            return None
        s = self.state.stats
        return s.last_step_s * 1000 if s is not None and s.steps else None

    def requests(self) -> list[ReqRow]:
        if self.state is None:
            return []
        return ([_req(self.name, r, False) for r in self.state.running or []]
                + [_req(self.name, r, True) for r in self.state.waiting or []])

    def tiers(self) -> list[Tier]:
        if self.state is None:
            return []
        pg = self.state.pages
        out = []
        if pg is not None:
            out.append(Tier("device", pg.total, pg.in_use, pg.cached, pg.free, pg.page_bytes, self.rates.get("evict"),
                            None))
        for t in _raw_tiers(self.state):
            ev, ld, sto = self.tier_rates.get(t.name, (None, None, None))
            out.append(Tier(t.name, t.total, t.in_use, t.cached, t.free, t.page_bytes, ev, ld, sto, t.hit_rate,
                            t.note, t.usage_known))
        return out

    def transfers(self) -> tuple[dict, list[InFlight], list[PeerView]]:
        """(counters, in-flight handoffs, peers) of a disaggregated role; empty for `serve`."""
        if self.state is None:
            return {}, [], []
        tr, routing = self.state.transfers, self.state.routing
        if tr is None and routing is None:
            return {}, [], []
        tr = tr or S.Transfers()  # a router: its routing counters, its targets as peers
        counters = {k: v for k, v in msgspec.structs.asdict(routing or tr).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
        names = {str(p.id): _peer_id(p) for p in self.state.peers or [] if p.id is not None}
        flights = []
        for f in tr.in_flight:
            detail = " ".join(f"{k} {getattr(f, k)}" for k in ("sent_pages", "xfers", "notifs")
                              if getattr(f, k) is not None)
            if f.fenced:
                detail += " fenced"
            peer = str(f.peer)
            flights.append(InFlight(self.name, f.rid, names.get(peer, peer), detail.strip(), f.age_s))
        peers = []
        for p in self.state.peers or []:
            pid = _peer_id(p)
            bits = [f"{k} {getattr(p, k)}" for k in ("point", "requests", "outstanding", "sessions", "load", "refused",
                                                     "connects") if getattr(p, k) not in (None, 0, False)]
            if p.error:
                bits.append(str(p.error))
            peers.append(PeerView(self.name, pid, p.kind, p.healthy, list(self.peer_hist.get(pid, ())),
                                  self.peer_rate.get(pid), p.bytes_sent, " ".join(bits)))
        if _xfer_bytes(self.state) is not None:
            peers.append(PeerView(self.name, "(all)", "total", None, list(self.peer_hist.get("(all)", ())),
                                  self.peer_rate.get("(all)"), _xfer_bytes(self.state), ""))
        return counters, flights, peers


# -- helpers ----------------------------------------------------------------------------------------

@dataclass
class _RawTier:
    name: str
    total: int
    in_use: int
    cached: int
    free: int
    page_bytes: int | None
    evicted: int | None
    loaded: int | None
    stored: int | None
    hit_rate: float | None
    note: str = ""
    usage_known: bool = True


def _raw_tiers(st: S.State | None) -> list[_RawTier]:
    """Cache tiers below the device pool: host L2 (its used slots hold cached pages, none in use) and
    the remote L3 as a client sees it. A `trnd store` node is itself one tier: its slots."""
    if st is None:
        return []
    if st.role == "store":
        return [_store_tier(st)]
    t = st.tiers
    out = []
    if t is not None and t.host is not None:
        h = t.host
        out.append(_RawTier("host", h.slots, 0, h.used, h.free, h.page_bytes, h.evicted, h.loaded, h.stored,
                            _ratio(h.hits, h.misses)))
    if t is not None and t.remote is not None:
        out.append(_remote_tier("remote", t.remote))
    return out


def _remote_tier(name: str, t: S.RemoteTier) -> _RawTier:
    """A client's view of its L3 stores: capacity and traffic; how full they are only the stores know."""
    stores = t.stores
    healthy = sum(1 for s in stores if s.healthy)
    note = f"{len(stores)} store{'s' if len(stores) != 1 else ''}, {healthy} healthy"
    if t.in_flight:
        note += f", {t.in_flight} reads in flight"
    return _RawTier(name, sum(s.slots or 0 for s in stores), 0, 0, 0, None, None, sum(s.pages_loaded for s in stores),
                    t.pages_written, _ratio(sum(s.hits for s in stores), sum(s.misses for s in stores)),
                    note, usage_known=False)


def _store_tier(st: S.State) -> _RawTier:
    sl, c = st.slots or S.Slots(), st.counters or {}
    held = sl.reserved + sl.pinned  # being written, or leased to a reader
    cached = max(0, sl.used - sl.pinned)
    clients = len(st.clients or [])
    return _RawTier("slots", sl.total, held, cached, sl.free, st.slot_bytes, c.get("evictions"), c.get("hits"),
                    c.get("committed"), _ratio(c.get("hits"), c.get("misses")),
                    f"{clients} client{'s' if clients != 1 else ''}")


def _ratio(hits, misses) -> float | None:
    return hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None


def _ranks(st: S.State) -> list[S.Rank]:
    return st.layout.ranks if st.layout is not None else []


def _xfer_bytes(st: S.State | None) -> int | None:
    """KV bytes a role has moved: prefill counts bytes sent; decode counts pages received."""
    tr = st.transfers if st is not None else None
    if tr is None:
        return None
    if tr.bytes is not None:
        return tr.bytes
    if tr.kv_pages_received is not None:
        return tr.kv_pages_received * ((st.pages.page_bytes if st.pages else None) or 0)
    return None


def _peer_id(p: S.Peer) -> str:
    """decode names its prefill peers by address; prefill knows its decode peers by agent name (and an id)."""
    return str(p.addr or p.agent or p.id or "?")


def _req(node: str, r: S.Request, queued: bool) -> ReqRow:
    return ReqRow(node=node, id=r.id, session=r.session_id, state=STATE_LABELS.get(r.state, r.state),
                  prompt=r.prompt_tokens, cached=r.cached_tokens, computed=r.computed_tokens,
                  generated=r.generated_tokens, max_tokens=r.max_tokens, pages=r.pages, tokens_per_s=r.tokens_per_s,
                  age_s=r.age_s, preemptions=r.preemptions, queued=queued)


# -- sorting and formatting -------------------------------------------------------------------------

SORTS: list[tuple[str, object]] = [
    ("age", lambda r: -r.age_s),
    ("tok/s", lambda r: -(r.tokens_per_s or 0.0)),
    ("generated", lambda r: -r.generated),
    ("prompt", lambda r: -r.prompt),
    ("session", lambda r: (r.session or "", r.id)),
    ("node", lambda r: (r.node, -r.age_s)),
]


def sort_rows(rows: list[ReqRow], sort: int) -> list[ReqRow]:
    """Running before queued, then the chosen key (ties by id, so the order is stable)."""
    key = SORTS[sort % len(SORTS)][1]
    return sorted(rows, key=lambda r: (r.queued, key(r), r.node, r.id))
