"""Plain data derived from `/admin/state` snapshots: what the panels and `--once` print.

Nothing here reads a clock or touches the network. Rates come from two successive snapshots of the
same process, timed by its own `uptime_s`, so a recorded pair of states renders the same every time;
the only local time is `now`, passed in by the caller (the app injects its clock), used for
"unreachable for 12 s".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from trnd.top.fmt import fmt_duration

HISTORY = 40  # samples per sparkline

STATE_LABELS = {"waiting": "waiting", "loading_kv": "loading KV", "waiting_for_kv": "waiting KV",
                "prefilling": "prefilling", "decoding": "decoding"}


@dataclass
class Poll:
    """One poll of a target: the /admin/state body (None when it failed) and what /ready said."""
    state: dict | None
    ready: str | None = None  # /ready's "status": ready | loading | draining; None if not known
    kind: str = "ok"  # ok | unreachable (refused, reset, DNS) | slow (no answer in time) | error (HTTP status)
    error: str | None = None


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
        self.state: dict | None = None  # latest good /admin/state
        self.prev: dict | None = None  # the one before, same process
        self.last: dict | None = None  # latest good state, kept while the target is down
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
        if prev is not None and st.get("uptime_s", 0) <= prev.get("uptime_s", 0):
            prev = None  # restarted (or the same snapshot twice): no rates across processes
            self.peer_hist.clear()
        self.prev, self.state, self.last = prev, st, st
        self.known = {"role": st.get("role", "?"), "model": st.get("model", "-"), "point": st.get("point"),
                      "tp": (st.get("layout") or {}).get("tp")}
        self._derive(prev, st)

    def _derive(self, prev: dict | None, st: dict) -> None:
        dt = (st["uptime_s"] - prev["uptime_s"]) if prev is not None else 0.0

        def rate(a: float | None, b: float | None) -> float | None:
            if prev is None or dt <= 0 or a is None or b is None:
                return None
            return max(0.0, (b - a) / dt)

        s0, s1 = (prev or {}).get("stats", {}), st.get("stats", {})
        r0, r1 = (prev or {}).get("radix", {}), st.get("radix", {})
        self.rates = {"gen": rate(s0.get("generation_tokens"), s1.get("generation_tokens")),
                      "prefill": rate(s0.get("prefill_tokens"), s1.get("prefill_tokens")),
                      "evict": rate(r0.get("evicted_pages"), r1.get("evicted_pages")),
                      "xfer": rate(_xfer_bytes(prev) if prev else None, _xfer_bytes(st))}
        dq = r1.get("query_tokens", 0) - r0.get("query_tokens", 0)
        self.hit_window = (r1.get("hit_tokens", 0) - r0.get("hit_tokens", 0)) / dq if prev and dq > 0 else None
        t0 = {t.name: t for t in _raw_tiers(prev)} if prev else {}
        self.tier_rates = {}
        for t in _raw_tiers(st):
            old = t0.get(t.name)
            self.tier_rates[t.name] = (rate(old.evicted, t.evicted) if old else None,
                                       rate(old.loaded, t.loaded) if old else None,
                                       rate(old.stored, t.stored) if old else None)
        # transfer throughput: per peer where the role counts bytes per peer, plus the node's total
        def byte_counts(state: dict | None) -> dict[str, int | None]:
            if state is None:
                return {}
            return {**{_peer_id(p): p.get("bytes_sent") for p in state.get("peers", [])}, "(all)": _xfer_bytes(state)}

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
        if p.state.get("draining") or p.ready == "draining":
            return "draining"
        if p.ready == "loading":
            return "loading"
        ranks = (p.state.get("layout") or {}).get("ranks") or []
        if any(not r.get("alive", True) for r in ranks):
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
        ranks = (p.state.get("layout") or {}).get("ranks") or []
        down = [str(r.get("rank")) for r in ranks if not r.get("alive", True)]
        if down:
            return f"rank {', '.join(down)} down"
        bad = [_peer_id(q) for q in p.state.get("peers", []) if q.get("healthy") is False]
        if bad:
            return f"peer {', '.join(bad)} unhealthy"
        return ""

    def step_ms(self) -> float | None:
        if self.state is None:
            return None
        s = self.state.get("stats", {})
        return s.get("last_step_s", 0.0) * 1000 if s.get("steps") else None

    def requests(self) -> list[ReqRow]:
        if self.state is None:
            return []
        return ([_req(self.name, r, False) for r in self.state.get("running", [])]
                + [_req(self.name, r, True) for r in self.state.get("waiting", [])])

    def tiers(self) -> list[Tier]:
        if self.state is None:
            return []
        pg = self.state.get("pages") or {}
        out = []
        if pg:
            out.append(Tier("device", pg.get("total", 0), pg.get("in_use", 0), pg.get("cached", 0),
                            pg.get("free", 0), pg.get("page_bytes"), self.rates.get("evict"), None))
        for t in _raw_tiers(self.state):
            ev, ld, sto = self.tier_rates.get(t.name, (None, None, None))
            out.append(Tier(t.name, t.total, t.in_use, t.cached, t.free, t.page_bytes, ev, ld, sto, t.hit_rate,
                            t.note, t.usage_known))
        return out

    def hot_prefixes(self) -> list[tuple[str, str]]:
        """(label, figures) for the hottest cached prefixes, if the state lists them."""
        if self.state is None:
            return []
        hot = self.state.get("hot_prefixes") or (self.state.get("radix") or {}).get("hot") or []
        out = []
        for h in hot:
            if not isinstance(h, dict):
                continue
            label = next((str(h[k]) for k in ("text", "prefix", "preview", "hash", "id") if h.get(k) is not None), "?")
            figs = [f"{h[k]} {k}" for k in ("hits", "tokens", "pages") if isinstance(h.get(k), (int, float))]
            out.append((label.replace("\n", "⏎"), " · ".join(figs)))
        return out

    def transfers(self) -> tuple[dict, list[InFlight], list[PeerView]]:
        """(counters, in-flight handoffs, peers) of a disaggregated role; empty for `serve`."""
        if self.state is None:
            return {}, [], []
        tr = self.state.get("transfers") or {}
        counters = {k: v for k, v in tr.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        names = {str(p.get("id")): _peer_id(p) for p in self.state.get("peers", []) if p.get("id") is not None}
        flights = []
        for f in tr.get("in_flight", []):
            detail = " ".join(f"{k} {f[k]}" for k in ("sent_pages", "xfers", "notifs") if k in f)
            if f.get("fenced"):
                detail += " fenced"
            peer = str(f.get("peer", "?"))
            flights.append(InFlight(self.name, str(f.get("rid", "?")), names.get(peer, peer), detail.strip(),
                                    float(f.get("age_s", 0.0))))
        peers = []
        for p in self.state.get("peers", []):
            pid = _peer_id(p)
            bits = [f"{k} {p[k]}" for k in ("requests", "outstanding", "load", "refused", "connects")
                    if p.get(k) not in (None, 0, False)]
            if p.get("error"):
                bits.append(str(p["error"]))
            peers.append(PeerView(self.name, pid, str(p.get("kind", "")), p.get("healthy"),
                                  list(self.peer_hist.get(pid, ())), self.peer_rate.get(pid), p.get("bytes_sent"),
                                  " ".join(bits)))
        if tr and _xfer_bytes(self.state) is not None:
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


def _raw_tiers(st: dict | None) -> list[_RawTier]:
    """Cache tiers below the device pool, from the optional `tiers` field: {"policy": ..., "host": {...},
    "remote": {...}} (a tier is any dict in it; a list of dicts with "name" is taken too). A host tier's
    used slots hold cached pages, none in use. A `trnd store` node is itself one tier: its slots."""
    if (st or {}).get("role") == "store":
        return [_store_tier(st)]
    raw = (st or {}).get("tiers") or []
    items = list(raw.items()) if isinstance(raw, dict) else [(t.get("name", f"tier{i}"), t) for i, t in
                                                             enumerate(raw) if isinstance(t, dict)]
    out = []
    for name, t in items:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get("stores"), list):
            out.append(_remote_tier(str(name), t))
            continue
        total = int(_first(t, "total", "slots", "total_pages", "capacity_pages") or 0)
        in_use = int(_first(t, "in_use") or 0)
        cached = int(_first(t, "cached", "cached_pages", "used") or 0)
        free = int(_first(t, "free") if _first(t, "free") is not None else max(0, total - in_use - cached))
        out.append(_RawTier(str(t.get("name", name)), total, in_use, cached, free, t.get("page_bytes"),
                            _first(t, "evicted", "evicted_pages", "evictions"),
                            _first(t, "loaded", "loaded_pages", "loads"), _first(t, "stored", "stored_pages"),
                            _ratio(_first(t, "hits"), _first(t, "misses"))))
    return out


def _remote_tier(name: str, t: dict) -> _RawTier:
    """A client's view of its L3 stores: capacity and traffic; how full they are only the stores know."""
    stores = [s for s in t["stores"] if isinstance(s, dict)]

    def total(key: str) -> int:
        return sum(int(s.get(key) or 0) for s in stores)

    healthy = sum(1 for s in stores if s.get("healthy"))
    note = f"{len(stores)} store{'s' if len(stores) != 1 else ''}, {healthy} healthy"
    if t.get("in_flight"):
        note += f", {t['in_flight']} reads in flight"
    return _RawTier(name, total("slots"), 0, 0, 0, None, None, total("pages_loaded"),
                    _first(t, "pages_written") if _first(t, "pages_written") is not None else total("pages_stored"),
                    _ratio(total("hits"), total("misses")),
                    note, usage_known=False)


def _store_tier(st: dict) -> _RawTier:
    sl, c = st.get("slots") or {}, st.get("counters") or {}
    held = int(sl.get("reserved", 0)) + int(sl.get("pinned", 0))  # being written, or leased to a reader
    cached = max(0, int(sl.get("used", 0)) - int(sl.get("pinned", 0)))
    clients = len(st.get("clients") or [])
    return _RawTier("slots", int(sl.get("total", 0)), held, cached, int(sl.get("free", 0)), st.get("slot_bytes"),
                    _first(c, "evictions"), _first(c, "hits"), _first(c, "committed"),
                    _ratio(_first(c, "hits"), _first(c, "misses")),
                    f"{clients} client{'s' if clients != 1 else ''}")


def _ratio(hits, misses) -> float | None:
    return hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None


def _first(d: dict, *keys: str):
    return next((d[k] for k in keys if isinstance(d.get(k), (int, float))), None)


def _xfer_bytes(st: dict | None) -> int | None:
    """KV bytes a role has moved: prefill counts bytes sent; decode counts pages received."""
    tr = (st or {}).get("transfers") or {}
    if isinstance(tr.get("bytes"), int):
        return tr["bytes"]
    if isinstance(tr.get("kv_pages_received"), int):
        return tr["kv_pages_received"] * ((st.get("pages") or {}).get("page_bytes") or 0)
    return None


def _peer_id(p: dict) -> str:
    """decode names its prefill peers by address; prefill knows its decode peers by agent name (and an id)."""
    return str(p.get("addr") or p.get("agent") or p.get("id") or "?")


def _req(node: str, r: dict, queued: bool) -> ReqRow:
    return ReqRow(node=node, id=str(r.get("id", "?")), session=r.get("session_id"),
                  state=STATE_LABELS.get(r.get("state", ""), str(r.get("state", "?"))),
                  prompt=r.get("prompt_tokens", 0), cached=r.get("cached_tokens", 0),
                  computed=r.get("computed_tokens", 0), generated=r.get("generated_tokens", 0),
                  max_tokens=r.get("max_tokens", 0), pages=r.get("pages", 0), tokens_per_s=r.get("tokens_per_s"),
                  age_s=float(r.get("age_s", 0.0)), preemptions=r.get("preemptions", 0), queued=queued)


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
