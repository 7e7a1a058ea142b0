"""`trnd decode`: owns the request (OpenAI API, tokenizing, sampling after the first token, streaming)
and the page pool that prefill servers write prompt KV into.

For a new request the scheduler reserves every prompt page (after its own prefix-cache match: the
pages it already holds are not sent), then the request goes to the least-loaded prefill peer. It joins
the decode batch once prefill's KVDone has arrived and every chunk's NIXL notification with it.
Pages a remote write may still reach are fenced: on abort until the peer confirms, on a lost peer
for `fence_s`, and only then freed. That handoff policy is the Inbox's (roles/inbox.py); this file
keeps the connections: handshake, heartbeat, reconnect, and the wiring.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from trnd import snapshot as S
from trnd.aio import reconnect, within
from trnd.config import DecodeConfig
from trnd.engine import trace
from trnd.engine.loop import EngineLoop, Unavailable
from trnd.engine.request import Req
from trnd.http.ids import admin_url
from trnd.log import PEER_START_GRACE_S, Failures
from trnd.procs import dial
from trnd.roles.common import build_engine, layout_from, manifest, point_capacity
from trnd.roles.inbox import FromPrefill, Inbox, PeerLink
from trnd.transfer import digest
from trnd.transfer import protocol as wire
from trnd.transfer.linkrate import LinkEstimate
from trnd.transfer.plan import make_plan, page_rows

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
    chan: wire.Channel | None = None
    agent_name: str | None = None
    manifest: wire.Manifest | None = None
    healthy: bool = False
    load: int = 0
    last_seen: float = 0.0
    plan: list | None = None  # how its pages map onto ours (transfer/plan.py): what the digest walks
    link: LinkEstimate = field(default_factory=LinkEstimate)  # its link's rate and its compute (linkrate.py)
    refused: str | None = None  # why the last handshake was refused
    error: str | None = None
    connects: int = 0
    kv_events: tuple[str | None, str | None] = (None, None)  # its KV events' endpoints (Welcome): for a router
    admin: str | None = None  # its /admin/state URL, from the welcome (trnd top follows it)
    failures: Failures = field(init=False)  # what the operator reads of a peer that stays away

    def __post_init__(self):
        self.failures = Failures(log, f"prefill {self.addr}", grace_s=PEER_START_GRACE_S)


def local_prefill_tokens(cfg: DecodeConfig) -> int:
    """The configured value, or auto: LOCAL_PREFILL_SHARED_CORES where the roles share the cores, else 0."""
    if cfg.local_prefill_tokens is not None:
        return cfg.local_prefill_tokens
    return LOCAL_PREFILL_SHARED_CORES if cfg.engine.core_lock else 0


class Refusal(ConnectionError):
    """The peer answered and said no (or does not match): its words, not a network error."""


class DecodeServer:
    def __init__(self, cfg: DecodeConfig, model_dir, model_name: str):
        self.cfg = cfg
        self.secret = cfg.resolved_secret()
        # UCX listens toward its peers: its API's host says nothing about where prefill reaches its pool
        self.engine, self.point = build_engine(model_dir, cfg, role="decode", secret=self.secret, bind_host=None,
                                               peers=cfg.prefill, max_model_len=cfg.max_model_len)
        self.engine.publish_kv_events(cfg.kv_events, cfg.http.host)
        self.model_name = model_name
        self.manifest = manifest(self.engine, self.point, "decode", model_name, cfg.engine.speculative_config)
        self.capacity = point_capacity(self.engine, self.point)
        self.agent = self.engine.agent
        self.layout = self.engine.layout
        self.memory = digest.Memory(self.engine.pools)
        self.engine.take_prompt_kv_from(self.ask_peer)
        self.loop = EngineLoop(self.engine, cfg.api.max_requests, poll=self._poll)
        self.peers = [PrefillPeer(a) for a in cfg.prefill]
        self.inbox = Inbox(self.engine, PeerLink(self._connected, self._send_to,
                                                 lambda: self._pick() is not None or self.fallback,
                                                 self._digest_mismatch, self._observe),
                           fence_s=cfg.fence_s, retries=cfg.prefill_retries, timeout_s=cfg.handoff_timeout_s)
        self.aio: asyncio.AbstractEventLoop | None = None
        self.local_prefills = 0
        self.local_for_link = 0  # prompts computed here: the link to the peer was slower (local_when_link_slower)
        self.prefill_by_prefix = 0  # handoffs to the peer a router found holding the prefix (_pick's hint)
        self.local_fallbacks = 0  # prompts prefilled here because no peer was left (local_fallback)
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

    @property
    def stats(self) -> dict:
        return {**self.inbox.stats, **self._own_stats()}

    def _own_stats(self) -> dict:
        """What this role decided about prompts (the Inbox counts the handoffs)."""
        return {"local_prefills": self.local_prefills, "local_for_link": self.local_for_link,
                "local_fallbacks": self.local_fallbacks, "prefill_by_prefix": self.prefill_by_prefix}

    # -- control plane (asyncio) --------------------------------------------------------------------

    async def start(self) -> None:
        self.aio = asyncio.get_running_loop()
        self.loop.start()
        for peer in self.peers:
            asyncio.create_task(self._peer_task(peer))

    async def _peer_task(self, peer: PrefillPeer) -> None:
        """Connect, handshake, serve; on loss, reconnect with backoff (a restarted prefill is simply
        handshaked again)."""
        def failed(e: BaseException) -> None:
            peer.error = str(e) or e.__class__.__name__
            if not peer.healthy:  # connecting or handshaking: bounded lines however long it lasts
                refused = isinstance(e, Refusal)
                if not refused:
                    peer.refused = None
                peer.failures.failed(peer.error if refused else f"unreachable: {peer.error}", absent=not refused)

        def lost() -> None:
            if peer.healthy or peer.chan is not None:
                self._lost(peer)

        await reconnect(lambda: self._connect(peer), lambda: self._serve_peer(peer), failed, lost)

    async def _connect(self, peer: PrefillPeer) -> None:
        host, port = peer.addr.rsplit(":", 1)
        reader, writer = await dial(host, int(port), 5)
        chan = wire.Channel(reader, writer, self.secret, name=f"prefill@{peer.addr}")
        regions = [wire.PoolRegion(base, self.engine.pool.num_pages) for base in self.agent.bases]
        try:
            await chan.answer(lambda nonce: wire.Hello(self.manifest, self.agent.name, self.agent.metadata(),
                                                       regions, nonce))
            reply = await within(chan.recv(strict=True), 10)
        except BaseException:
            chan.close()
            raise
        if isinstance(reply, wire.Refused):
            chan.close()
            peer.refused = reply.reason
            raise Refusal(f"refused the handshake: {reply.reason}")
        if not isinstance(reply, wire.Welcome):
            chan.close()
            raise ConnectionError(f"unexpected {type(reply).__name__} in handshake")
        why = wire.mismatch(self.manifest, reply.manifest)
        if why is not None:
            chan.close()
            peer.refused = why
            raise Refusal(f"does not match this decode server: {why}")
        name = await self.loop.run_on_loop(lambda: self._handshaked(peer, reply.agent_meta))
        peer.chan, peer.agent_name, peer.manifest = chan, name, reply.manifest
        peer.kv_events = (reply.kv_events, reply.kv_events_replay)
        peer.admin = admin_url(peer.addr, reply.admin_port)
        peer.plan = make_plan(layout_from(reply.manifest), self.layout)
        peer.refused, peer.error = None, None
        peer.healthy, peer.last_seen = True, time.monotonic()
        self._had_peer = True
        peer.connects += 1
        log.info("prefill %s handshaked (agent %s, tp=%d ep=%d)%s", peer.addr, name, reply.manifest.tp,
                 reply.manifest.ep, peer.failures.recovered() or "")

    def _handshaked(self, peer: PrefillPeer, meta: bytes) -> str:
        """Engine thread: the peer's earlier session is over (Inbox.handshaked)."""
        self.inbox.handshaked(peer.addr)
        return self.agent.add_peer(meta)

    async def _serve_peer(self, peer: PrefillPeer) -> None:
        chan, inbox = peer.chan, self.inbox
        pinger = asyncio.create_task(self._pinger(peer))
        try:
            while True:
                msg = await within(chan.recv(), self.cfg.peer_timeout_s)
                peer.last_seen = time.monotonic()
                if isinstance(msg, wire.KVDone):
                    self.loop.call(lambda m=msg: inbox.kv_done(m))
                elif isinstance(msg, wire.Aborted):
                    self.loop.call(lambda m=msg: inbox.aborted(m.rid))
                elif isinstance(msg, wire.PrefillFailed):
                    self.loop.call(lambda m=msg: inbox.failed(m.rid, m.reason))
                elif isinstance(msg, wire.Pong):
                    peer.load = msg.load
                else:
                    chan.reject(f"unexpected {type(msg).__name__}")
        except asyncio.TimeoutError:
            raise ConnectionError(f"no message for {self.cfg.peer_timeout_s} s (heartbeat)") from None
        finally:
            pinger.cancel()

    async def _pinger(self, peer: PrefillPeer) -> None:
        while True:
            await peer.chan.send(wire.Ping(time.time()))
            await asyncio.sleep(self.cfg.heartbeat_s)

    def _lost(self, peer: PrefillPeer) -> None:
        if peer.chan is not None:
            peer.chan.close()
        peer.chan, peer.healthy = None, False
        log.warning("prefill %s lost: %s", peer.addr, peer.error)
        self.loop.call(lambda: self._peer_lost(peer))

    def _peer_lost(self, peer: PrefillPeer) -> None:
        """Engine thread: its NIXL peer goes; its handoffs are the Inbox's to settle."""
        if peer.agent_name:
            self.agent.remove_peer(peer.agent_name)
        self.inbox.peer_lost(peer.addr)

    def _send_to(self, addr: str, msg) -> None:
        """From the engine thread: queue a control message on the asyncio loop."""
        peer = self._peer(addr)
        chan = peer.chan if peer is not None else None
        if chan is not None and self.aio is not None:
            asyncio.run_coroutine_threadsafe(self._send_safe(chan, msg), self.aio)

    async def _send_safe(self, chan: wire.Channel, msg) -> None:
        try:
            await chan.send(msg)
        except (ConnectionError, OSError) as e:
            log.warning("send to %s failed: %s", chan.name, e)
        except Exception as e:  # e.g. a value msgpack cannot encode: the request must not wait forever
            log.error("could not send %s to %s: %s: %s", type(msg).__name__, chan.name, type(e).__name__, e)
            if isinstance(msg, wire.PrefillReq):
                why = f"the handoff could not start ({e})"  # bound now: `e` is gone when the call runs
                self.loop.call(lambda: self.inbox.failed(msg.rid, why))

    # -- engine thread: the scheduler's "KV from a peer" source --------------------------------------

    def _connected(self, addr: str) -> bool:
        peer = self._peer(addr)
        return peer is not None and peer.chan is not None

    def _pick(self, hint: str | None = None) -> PrefillPeer | None:
        """The least-loaded healthy peer; or `hint`, the peer a router found holding the prompt's prefix (its
        KV events: router/events.py), unless it carries PREFILL_HINT_SLACK more handoffs than the least."""
        live = [p for p in self.peers if p.healthy]
        if not live:
            return None
        least = min(live, key=lambda p: (self.inbox.outstanding(p.addr), p.load))
        held = next((p for p in live if p.addr == hint), None) if hint else None
        if held is not None and self.inbox.outstanding(held.addr) <= self.inbox.outstanding(least.addr) \
                + PREFILL_HINT_SLACK:
            self.prefill_by_prefix += 1
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
            self.local_prefills += 1
            trace.phase(req, f"prefilled here: {uncached} uncached tokens, local_prefill_tokens "
                             f"{self.local_prefill_tokens}")
            return None
        peer = self._pick(req.params.prefill_hint)
        slow = peer is not None and self.cfg.local_when_link_slower and peer.link.slower_than_recompute(
            uncached, self.engine.runner.page_bytes * self.engine.tp.size // self.point.page_size)
        if slow:
            self.local_for_link += 1
            trace.phase(req, f"prefilled here: moving {uncached} tokens' KV from {peer.addr} would take "
                             f"~{slow[0]:.2f} s at {peer.link.bytes_per_s / 1e6:.0f} MB/s, computing them "
                             f"~{slow[1]:.2f} s (local_when_link_slower)")
            return None
        if peer is None:
            reasons = "; ".join(f"{p.addr}: {p.refused or p.error or 'connecting'}" for p in self.peers)
            if self.fallback:
                self.local_fallbacks += 1
                trace.phase(req, f"prefilled here: no prefill server left ({reasons}; local_fallback)")
                return None
            return FromPrefill(self.inbox, req, Unavailable(f"no prefill server available ({reasons})"))
        return self.inbox.expect(req, peer.addr, req.num_cached // self.point.page_size)

    def _poll(self) -> bool:
        return self.inbox.poll(self.agent.notifs())

    def _digest_mismatch(self, req: Req, a) -> str | None:
        """PeerLink.verify: hash what landed in the target pages (transfer/digest.py) against the peer's
        digest of what it wrote; None when they agree (or the peer took none)."""
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

    def _observe(self, a, nbytes: int) -> None:
        """PeerLink.observe: a landed handoff's pace, for the peer's link estimate (transfer/linkrate.py)."""
        peer = self._peer(a.peer)
        if peer is not None:
            m = a.done
            peer.link.observe(nbytes, a.notifs, a.first_notif, a.last_notif, m.computed_tokens, m.prefill_s)

    # -- inspection ---------------------------------------------------------------------------------

    def state_extra(self) -> dict:
        """decode's part of /admin/state (trnd/snapshot.py)."""
        now = time.monotonic()
        return {
            "role": "decode",
            "point": self.point.name,
            "capacity": S.Capacity(**{k: v for k, v in msgspec.structs.asdict(self.capacity).items() if k != "point"}),
            "transfers": self.inbox.transfers(now, **self._own_stats()),
            "peers": [S.Peer(addr=p.addr, kind="prefill", healthy=p.healthy, agent=p.agent_name,
                             outstanding=self.inbox.outstanding(p.addr), load=p.load, refused=p.refused,
                             error=p.error, connects=p.connects, kv_events=p.kv_events[0],
                             kv_events_replay=p.kv_events[1], admin=p.admin,
                             last_seen_s=round(now - p.last_seen, 2) if p.last_seen else None) for p in self.peers],
        }


def run(cfg: DecodeConfig, reload_source=None) -> int:
    """Load, serve HTTP, wait for a prefill peer, warm up through it, READY; drain on SIGTERM."""
    from trnd.api.server import build_app
    from trnd.daemon.lifecycle import Lifecycle
    from trnd.engine.warmup import warm_up_loop
    from trnd.roles.runtime import http_server, run_async
    from trnd.model.hub import served_name
    from trnd.model.maker import resolve_model
    from trnd.procs import bind_port

    from trnd.transfer.backends import prepare

    prepare(cfg.engine.transfer_backend)  # a backend that cannot load here: one line, exit 78, before the load
    sock = bind_port(cfg.http.host, cfg.http.port, "port")  # another process on it: one line, exit 1, before the load
    with Lifecycle("decode", cfg, reload_source) as life:
        model_dir = resolve_model(cfg.model)
        name = cfg.api.served_model_name or served_name(model_dir)
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
