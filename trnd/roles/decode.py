"""`trnd decode`: owns the request (OpenAI API, tokenizing, sampling after the first token, streaming)
and the page pool that prefill servers write prompt KV into.

For a new request the scheduler reserves every prompt page (after its own prefix-cache match: the
pages it already holds are not sent), then the request goes to the least-loaded prefill peer. It joins
the decode batch once prefill's KVDone has arrived and every chunk's NIXL notification with it.
Pages a remote write may still reach are fenced: on abort until the peer confirms, on a lost peer
for `fence_s`, and only then freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from trnd import snapshot as S
from trnd.aio import within
from trnd.config import DecodeConfig
from trnd.engine import trace
from trnd.engine.loop import DeadlineExceeded, EngineLoop, Unavailable
from trnd.engine.parked import Landing, Parked
from trnd.engine.request import Req
from trnd.engine.sampler import SampleOut
from trnd.log import Failures
from trnd.procs import dial
from trnd.roles.common import build_engine, layout_from, manifest, point_capacity
from trnd.transfer import digest
from trnd.transfer import protocol as P
from trnd.transfer.plan import make_plan, page_rows
from trnd.transfer.handoff import Awaited
from trnd.transfer.linkrate import LinkEstimate

log = logging.getLogger("trnd.decode")

# `local_prefill_tokens` where the roles take turns on one node's cores (core_lock): there a prefill peer
# adds no compute, and a prompt handed to it costs a forward pass of its own (the weights read again,
# where here its chunk rides in a decode step), the KV write and two control hops. Dynamo's default for
# its max_local_prefill_length; longer prompts still go to the peer.
LOCAL_PREFILL_SHARED_CORES = 1000
PREFILL_HINT_SLACK = 2  # a router's prefix pick of prefill peer may carry this many more handoffs than the least


@dataclass
class PrefillPeer:
    addr: str
    chan: P.Channel | None = None
    agent_name: str | None = None
    manifest: P.Manifest | None = None
    healthy: bool = False
    load: int = 0
    last_seen: float = 0.0
    plan: list | None = None  # how its pages map onto ours (transfer/plan.py): what the digest walks
    link: LinkEstimate = field(default_factory=LinkEstimate)  # its link's rate and its compute (linkrate.py)
    refused: str | None = None  # why the last handshake was refused
    error: str | None = None
    connects: int = 0
    kv_events: tuple[str | None, str | None] = (None, None)  # its KV events' endpoints (Welcome): for a router
    failures: Failures = field(init=False)  # what the operator reads of a peer that stays away

    def __post_init__(self):
        self.failures = Failures(log, f"prefill {self.addr}")


def local_prefill_tokens(cfg: DecodeConfig) -> int:
    """The configured value, or auto: LOCAL_PREFILL_SHARED_CORES where the roles share the cores, else 0."""
    if cfg.local_prefill_tokens is not None:
        return cfg.local_prefill_tokens
    return LOCAL_PREFILL_SHARED_CORES if cfg.engine.core_lock else 0


class Refusal(ConnectionError):
    """The peer answered and said no (or does not match): its words, not a network error."""


class FromPrefill(Parked):
    """A request parked in the scheduler while a prefill peer writes its prompt's KV (engine/parked.py).
    Its books are in the decode server's `Awaited` ledger (transfer/handoff.py), keyed by rid."""
    phase = "waiting_for_kv"

    def __init__(self, server: "DecodeServer", req: Req, error: BaseException | None = None):
        super().__init__(req)
        self.server, self.error = server, error

    def done(self) -> bool:
        return self.error is not None or self.server.awaited.ended(self.req.rid)

    def abort(self) -> None:
        super().abort()
        if self.error is None:
            self.server.fence(self.req.rid)

    def result(self) -> Landing:
        return self.server.landing(self, self.server.awaited.forget(self.req.rid))


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


class DecodeServer:
    def __init__(self, cfg: DecodeConfig, model_dir, model_name: str):
        self.cfg = cfg
        self.secret = cfg.resolved_secret()
        # UCX listens toward its peers: its API's host says nothing about where prefill reaches its pool
        self.engine, self.point = build_engine(model_dir, cfg, role="decode", secret=self.secret, bind_host=None,
                                               peers=cfg.prefill, max_model_len=cfg.max_model_len)
        self.engine.publish_kv_events(cfg.kv_events, cfg.http.host)
        self.model_name = model_name
        self.manifest = manifest(self.engine, self.point, "decode", model_name, cfg.speculative_config)
        self.capacity = point_capacity(self.engine, self.point)
        self.agent = self.engine.agent
        self.layout = self.engine.layout
        self.memory = digest.Memory(self.engine.pools)
        self.engine.take_prompt_kv_from(self.ask_peer)
        self.loop = EngineLoop(self.engine, cfg.api.max_requests, poll=self._poll)
        self.peers = [PrefillPeer(a) for a in cfg.prefill]
        self.awaited = Awaited()  # every request a peer is writing KV for (transfer/handoff.py)
        self.xfer_metrics = self.engine.xfer_metrics  # per prefill peer: op kv_receive (handoff sent -> KV landed)
        self.aio: asyncio.AbstractEventLoop | None = None
        self.stats = {"handoffs": 0, "retried": 0, "failed": 0, "fenced": 0, "timed_out": 0,
                      "kv_pages_received": 0, "kv_bytes_received": 0, "local_prefills": 0, "local_fallbacks": 0,
                      "digest_failures": 0, "local_for_link": 0, "prefill_by_prefix": 0}
        self.local_prefill_tokens = local_prefill_tokens(cfg)
        self._had_peer = False  # a peer handshaked once: from then on, losing all of them is the local fallback
        if self.local_prefill_tokens:
            log.info("prompts of at most %d uncached tokens are prefilled here, longer ones by a prefill peer "
                     "(local_prefill_tokens%s)", self.local_prefill_tokens,
                     "" if cfg.local_prefill_tokens is not None else ": auto, the roles share this node's cores")

    @property
    def ready(self) -> bool:
        """A prefill peer handshaked; after the first, also none (every peer lost) where local_fallback is on."""
        return any(p.healthy for p in self.peers) or self.fallback

    @property
    def fallback(self) -> bool:
        """No peer is left to take a prompt, and this server prefills them itself (local_fallback): a hung peer
        (missed heartbeats for peer_timeout_s) and a dead one alike."""
        return self._had_peer and self.cfg.local_fallback and not any(p.healthy for p in self.peers)

    # -- control plane (asyncio) --------------------------------------------------------------------

    async def start(self) -> None:
        self.aio = asyncio.get_running_loop()
        self.loop.start()
        for peer in self.peers:
            asyncio.create_task(self._peer_task(peer))

    async def _peer_task(self, peer: PrefillPeer) -> None:
        """Connect, handshake, serve; on loss, reconnect with backoff (a restarted prefill is simply
        handshaked again)."""
        backoff = 0.2
        while True:
            try:
                await self._connect(peer)
                backoff = 0.2
                await self._serve_peer(peer)
            except (P.ChannelClosed, ConnectionError, OSError, asyncio.TimeoutError) as e:
                peer.error = str(e) or e.__class__.__name__
                if not peer.healthy:  # connecting or handshaking: bounded lines however long it lasts
                    if not isinstance(e, Refusal):
                        peer.refused = None
                    peer.failures.failed(peer.error if isinstance(e, Refusal) else f"unreachable: {peer.error}")
            if peer.healthy or peer.chan is not None:
                self._lost(peer)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _connect(self, peer: PrefillPeer) -> None:
        host, port = peer.addr.rsplit(":", 1)
        reader, writer = await dial(host, int(port), 5)
        chan = P.Channel(reader, writer, self.secret, name=f"prefill@{peer.addr}")
        regions = [P.PoolRegion(base, self.engine.pool.num_pages) for base in self.agent.bases]
        try:
            await chan.answer(lambda nonce: P.Hello(self.manifest, self.agent.name, self.agent.metadata(), regions,
                                                    nonce))
            reply = await within(chan.recv(strict=True), 10)
        except BaseException:
            chan.close()
            raise
        if isinstance(reply, P.Refused):
            chan.close()
            peer.refused = reply.reason
            raise Refusal(f"refused the handshake: {reply.reason}")
        if not isinstance(reply, P.Welcome):
            chan.close()
            raise ConnectionError(f"unexpected {type(reply).__name__} in handshake")
        why = P.mismatch(self.manifest, reply.manifest)
        if why is not None:
            chan.close()
            peer.refused = why
            raise Refusal(f"does not match this decode server: {why}")
        name = await self.loop.run_on_loop(lambda: self._handshaked(peer, reply.agent_meta))
        peer.chan, peer.agent_name, peer.manifest = chan, name, reply.manifest
        peer.kv_events = (reply.kv_events, reply.kv_events_replay)
        peer.plan = make_plan(layout_from(reply.manifest), self.layout)
        peer.refused, peer.error = None, None
        peer.healthy, peer.last_seen = True, time.monotonic()
        self._had_peer = True
        peer.connects += 1
        log.info("prefill %s handshaked (agent %s, tp=%d)%s", peer.addr, name, reply.manifest.tp,
                 peer.failures.recovered() or "")

    def _handshaked(self, peer: PrefillPeer, meta: bytes) -> str:
        """Engine thread: a Welcome means the peer's earlier session is over (prefill settles it before
        answering; a new process means the old one is gone): its quarantined pages are free again."""
        for pages in self.awaited.release(peer.addr):
            self.engine.drop(pages)
        return self.agent.add_peer(meta)

    async def _serve_peer(self, peer: PrefillPeer) -> None:
        chan = peer.chan
        pinger = asyncio.create_task(self._pinger(peer))
        try:
            while True:
                msg = await within(chan.recv(), self.cfg.peer_timeout_s)
                peer.last_seen = time.monotonic()
                if isinstance(msg, P.KVDone):
                    self.loop.call(lambda m=msg: self.awaited.kv_done(m.rid, m))
                elif isinstance(msg, P.Aborted):
                    self.loop.call(lambda m=msg: self._settled(m.rid) or self.awaited.aborted(m.rid))
                elif isinstance(msg, P.PrefillFailed):
                    self.loop.call(lambda m=msg: self._settled(m.rid)
                                   or self.awaited.failed(m.rid, m.reason, time.monotonic()))
                elif isinstance(msg, P.Pong):
                    peer.load = msg.load
                else:
                    chan._reject(f"unexpected {type(msg).__name__}")
        except asyncio.TimeoutError:
            raise ConnectionError(f"no message for {self.cfg.peer_timeout_s} s (heartbeat)") from None
        finally:
            pinger.cancel()

    async def _pinger(self, peer: PrefillPeer) -> None:
        while True:
            await peer.chan.send(P.Ping(time.time()))
            await asyncio.sleep(self.cfg.heartbeat_s)

    def _lost(self, peer: PrefillPeer) -> None:
        if peer.chan is not None:
            peer.chan.close()
        peer.chan, peer.healthy = None, False
        log.warning("prefill %s lost: %s", peer.addr, peer.error)
        self.loop.call(lambda: self._peer_lost(peer))

    def _send(self, peer: PrefillPeer, msg) -> None:
        chan = peer.chan
        if chan is not None and self.aio is not None:
            asyncio.run_coroutine_threadsafe(self._send_safe(chan, msg), self.aio)

    async def _send_safe(self, chan: P.Channel, msg) -> None:
        try:
            await chan.send(msg)
        except (ConnectionError, OSError) as e:
            log.warning("send to %s failed: %s", chan.name, e)
        except Exception as e:  # e.g. a value msgpack cannot encode: the request must not wait forever
            log.error("could not send %s to %s: %s: %s", type(msg).__name__, chan.name, type(e).__name__, e)
            if isinstance(msg, P.PrefillReq):
                why = f"the handoff could not start ({e})"  # bound now: `e` is gone when the call runs
                self.loop.call(lambda: self.awaited.failed(msg.rid, why))

    def _settled(self, rid: str) -> bool:
        """The peer's word on a timed-out handoff: no write can land any more, free its pages."""
        pages = self.awaited.settled(rid)
        if pages is not None:
            self.engine.drop(pages)
        return pages is not None

    # -- engine thread: the scheduler's "KV from a peer" source --------------------------------------

    def _pick(self, hint: str | None = None) -> PrefillPeer | None:
        """The least-loaded healthy peer; or `hint`, the peer a router found holding the prompt's prefix (its
        KV events: router/events.py), unless it carries PREFILL_HINT_SLACK more handoffs than the least."""
        live = [p for p in self.peers if p.healthy]
        if not live:
            return None
        least = min(live, key=lambda p: (self.awaited.outstanding(p.addr), p.load))
        held = next((p for p in live if p.addr == hint), None) if hint else None
        if held is not None and self.awaited.outstanding(held.addr) <= self.awaited.outstanding(least.addr) \
                + PREFILL_HINT_SLACK:
            self.stats["prefill_by_prefix"] += 1
            return held
        return least

    def _peer(self, addr: str) -> PrefillPeer | None:
        return next((p for p in self.peers if p.addr == addr), None)

    def ask_peer(self, req: Req) -> FromPrefill | None:
        """Admitted with every prompt page reserved (after this server's own prefix match: those pages
        are not sent): ask the least-loaded healthy peer for the rest, or None: a prompt whose uncached
        part is at most local_prefill_tokens is computed here (Dynamo's conditional disaggregation)."""
        uncached = req.num_prompt - req.num_cached
        if uncached <= self.local_prefill_tokens:
            self.stats["local_prefills"] += 1
            trace.phase(req, f"prefilled here: {uncached} uncached tokens, local_prefill_tokens "
                             f"{self.local_prefill_tokens}")
            return None
        peer = self._pick(req.params.prefill_hint)
        slow = peer is not None and self.cfg.local_when_link_slower and peer.link.slower_than_recompute(
            uncached, self.engine.runner.page_bytes * self.engine.tp.size // self.point.page_size)
        if slow:
            self.stats["local_for_link"] += 1
            trace.phase(req, f"prefilled here: moving {uncached} tokens' KV from {peer.addr} would take "
                             f"~{slow[0]:.2f} s at {peer.link.bytes_per_s / 1e6:.0f} MB/s, computing them "
                             f"~{slow[1]:.2f} s (local_when_link_slower)")
            return None
        if peer is None:
            reasons = "; ".join(f"{p.addr}: {p.refused or p.error or 'connecting'}" for p in self.peers)
            if self.fallback:
                self.stats["local_fallbacks"] += 1
                trace.phase(req, f"prefilled here: no prefill server left ({reasons}; local_fallback)")
                return None
            return FromPrefill(self, req, Unavailable(f"no prefill server available ({reasons})"))
        skip = req.num_cached // self.point.page_size
        req.handoffs += 1
        now, timeout = time.monotonic(), self.cfg.handoff_timeout_s
        self.awaited.expect(req.rid, peer.addr, req.pages[skip:], now, now + timeout)
        self.stats["handoffs"] += 1
        self.xfer_metrics.start("kv_receive", peer.addr, key=req.rid)
        self._send(peer, P.PrefillReq(req.rid, req.prompt_ids, req.params, skip, req.pages[skip:],
                                      expires=time.time() + timeout, session=req.session_id))
        trace.phase(req, f"handed to prefill {peer.addr}: {req.num_prompt - req.num_cached} tokens to write, "
                         f"{req.num_cached} held here")
        return FromPrefill(self, req)

    def landing(self, job: FromPrefill, a) -> Landing:
        """What the scheduler does with a request whose peer is done with it."""
        req = job.req
        if job.error is not None:
            return Landing(error=job.error)
        if a is None or job.aborted or a.over == "aborted":
            self.xfer_metrics.end("kv_receive", ok=None, key=req.rid)
            return Landing()  # released by the scheduler: nothing can land any more
        ok = a.over is None
        bad = ok and self._digest_mismatch(req, a)
        if bad:
            ok = False
            self.stats["digest_failures"] += 1
            log.error("handoff of %s from %s: %s", req.rid, a.peer, bad)
            trace.phase(req, f"KV digest failed: {bad}")
        self.xfer_metrics.end("kv_receive", nbytes=len(a.target) * self.engine.runner.page_bytes * self.engine.tp.size
                              if ok else 0, ok=ok, key=req.rid)
        if ok:
            m = a.done
            peer = self._peer(a.peer)
            if peer is not None:
                peer.link.observe(len(a.target) * self.engine.runner.page_bytes * self.engine.tp.size, a.notifs,
                                  a.first_notif, a.last_notif, m.computed_tokens, m.prefill_s)
            trace.phase(req, f"KV received from {a.peer}: {req.num_prompt - req.num_cached} tokens written, "
                             f"{m.computed_tokens} computed there, its cache hits {m.cached_from}")
            self.stats["kv_pages_received"] += len(a.target)
            self.stats["kv_bytes_received"] += len(a.target) * self.engine.runner.page_bytes
            return Landing(first=SampleOut(m.token, m.logprob, m.top_logprobs), computed_tokens=m.computed_tokens,
                           cached_from=peer_hits(m.cached_from, req.num_cached), received=req.num_prompt - req.num_cached)
        if bad:  # every write landed (nothing in flight): the pages are free to take again
            if req.handoffs <= self.cfg.prefill_retries:
                self.stats["retried"] += 1
                return Landing(retry=True)
            self.stats["failed"] += 1
            return Landing(error=Unavailable(f"prefill {a.peer}: {bad}"))
        if a.over == "lost":  # its target pages are in quarantine (held); retry elsewhere or fail
            if req.handoffs <= self.cfg.prefill_retries and (self._pick() is not None or self.fallback):
                self.stats["retried"] += 1
                return Landing(retry=True)
            self.stats["failed"] += 1
            return Landing(error=Unavailable(f"prefill server {a.peer} was lost during the request"))
        self.stats["failed"] += 1
        if a.over == "timeout":
            return Landing(error=DeadlineExceeded(a.reason))
        return Landing(error=Unavailable(f"prefill failed: {a.reason}"))

    def _digest_mismatch(self, req: Req, a) -> str | None:
        """Hash what landed in the target pages (transfer/digest.py) against the peer's digest of what
        it wrote; None when they agree (or the peer took none)."""
        m = a.done
        if not m.digest:
            return None
        peer = self._peer(a.peer)
        if peer is None or peer.plan is None:
            return "the peer's layout is unknown (it reconnected): the KV cannot be checked"
        src = layout_from(peer.manifest)
        _, rows = page_rows(peer.plan, src, self.layout, [0] * len(src.rank_heads), self.agent.bases,
                            [0] * len(a.target), a.target)
        h = digest.new()
        self.memory.update(h, rows)
        if h.digest() != m.digest:
            return (f"the KV that landed ({len(a.target)} pages) does not match the digest of what prefill wrote: "
                    f"not decoded from")
        trace.phase(req, f"KV digest verified: {int(rows[:, 1].sum()) / 2**20:.1f} MiB, "
                                      f"{m.num_xfers} writes, {m.descriptors} descriptors")
        return None

    def fence(self, rid: str) -> None:
        """Engine abort of a parked request: keep its pages until the peer confirms nothing is in flight."""
        a = self.awaited.entries.get(rid)
        peer = self._peer(a.peer) if a is not None else None
        if self.awaited.fence(rid, connected=peer is not None and peer.chan is not None):
            self.stats["fenced"] += 1
            self._send(peer, P.Abort(rid))

    def _poll(self) -> bool:
        for _agent, msgs in self.agent.notifs().items():
            for m in msgs:
                rid, _, _ = m.decode(errors="replace").rpartition("|")
                self.awaited.notified(rid, time.monotonic())
        now = time.monotonic()
        for a in self.awaited.overdue(now):  # stalled: fail it now, hold its pages until the peer's word
            log.warning("handoff of %s: %s", a.rid, a.reason)
            self.stats["timed_out"] += 1
            self.engine.hold(a.target)
            peer = self._peer(a.peer)
            if peer is not None and peer.chan is not None:
                self._send(peer, P.Abort(a.rid))
            else:  # not connected: nothing new can be posted; what was may still land within fence_s
                addr, pages = self.awaited.cut.pop(a.rid)
                self.awaited.quarantine.append((now + self.cfg.fence_s, pages, addr))
        if self.awaited.quarantine:
            for pages in self.awaited.expire(now):
                self.engine.drop(pages)
        # Busy (poll again within the ms) while a landing's notifications are due, or while only fences and
        # quarantines are left (no engine work); a handoff still computing on its peer ends with a KVDone,
        # whose arrival wakes the loop (EngineLoop.call), so it needs no polling.
        return self.awaited.landing() or (bool(self.awaited) and not self.engine.has_work)

    def _peer_lost(self, peer: PrefillPeer) -> None:
        """Everything sent to it: target pages rest in quarantine (a write could still be on the wire);
        the scheduler then releases the rest and retries each request on another peer or fails it."""
        if peer.agent_name:
            self.agent.remove_peer(peer.agent_name)
        for a in self.awaited.peer_lost(peer.addr, time.monotonic(), self.cfg.fence_s):
            self.engine.hold(a.target)

    # -- inspection ---------------------------------------------------------------------------------

    def state_extra(self) -> dict:
        """decode's part of /admin/state (trnd/snapshot.py)."""
        now = time.monotonic()
        return {
            "role": "decode",
            "point": self.point.name,
            "capacity": S.Capacity(**{k: v for k, v in msgspec.structs.asdict(self.capacity).items() if k != "point"}),
            "transfers": S.Transfers(
                in_flight=[S.InFlight(rid=rid, peer=a.peer, notifs=a.notifs, fenced=a.fenced,
                                      age_s=round(now - a.sent_at, 3)) for rid, a in self.awaited.entries.items()],
                quarantined_pages=self.awaited.quarantined_pages(), **self.stats),
            "peers": [S.Peer(addr=p.addr, kind="prefill", healthy=p.healthy, agent=p.agent_name,
                             outstanding=self.awaited.outstanding(p.addr), load=p.load, refused=p.refused,
                             error=p.error, connects=p.connects, kv_events=p.kv_events[0],
                             kv_events_replay=p.kv_events[1],
                             last_seen_s=round(now - p.last_seen, 2) if p.last_seen else None) for p in self.peers],
        }


def run(cfg: DecodeConfig, reload_source=None) -> int:
    """Load, serve HTTP, wait for a prefill peer, warm up through it, READY; drain on SIGTERM."""
    from trnd.api.server import build_app
    from trnd.daemon.lifecycle import Lifecycle
    from trnd.engine.warmup import warm_up_loop
    from trnd.roles.runtime import http_server, run_async
    from trnd.model.maker import resolve_model
    from trnd.procs import bind_port

    from trnd.transfer.backends import prepare

    prepare(cfg.engine.transfer_backend)  # a backend that cannot load here: one line, exit 78, before the load
    sock = bind_port(cfg.http.host, cfg.http.port, "port")  # another process on it: one line, exit 1, before the load
    with Lifecycle("decode", cfg, reload_source) as life:
        model_dir = resolve_model(cfg.model)
        name = cfg.api.served_model_name or model_dir.resolve().name
        life.status(f"loading {model_dir}")
        server = DecodeServer(cfg, model_dir, name)
        life.loop = server.loop
        app = build_app(server.loop, cfg, name, server.state_extra)
        st = app.state.trnd
        st.metrics.role_stats = lambda: {f"decode_{k}": server.stats[k] for k in
                                         ("handoffs", "retried", "failed", "timed_out", "fenced", "local_prefills",
                                          "local_fallbacks")}
        st.ready_fn = lambda: server.ready
        http = http_server(app, cfg.http, sock=sock)

        def waiting() -> str:
            return "no prefill peer yet: " + "; ".join(f"{p.addr}: {p.refused or p.error or 'connecting'}"
                                                       for p in server.peers)

        st.not_ready_why = waiting

        async def main() -> int:
            await server.start()
            return await life.serve(
                http, st, banner=f"trnd: decode for {name} (point {cfg.point}, tp={cfg.engine.tp}) on "
                                  f"http://{cfg.http.host}:{cfg.http.port}/v1, prefill peers {', '.join(cfg.prefill)}",
                ready_fn=lambda: server.ready, waiting=waiting, warmup=lambda: warm_up_loop(server.loop),
                in_flight=lambda: server.loop.num_requests, abort=st.abort_all)

        try:
            return run_async(main)
        finally:
            server.loop.stop()
            server.engine.close()
