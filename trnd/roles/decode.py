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

from trnd.config import DecodeConfig
from trnd.engine.loop import EngineLoop, Unavailable
from trnd.engine.request import Req, Status
from trnd.engine.sampler import SampleOut
from trnd.engine.scheduler import Batch
from trnd.roles.common import build_engine, layout_of, manifest
from trnd.transfer import protocol as P

log = logging.getLogger("trnd.decode")


@dataclass
class PrefillPeer:
    addr: str
    chan: P.Channel | None = None
    agent_name: str | None = None
    manifest: P.Manifest | None = None
    healthy: bool = False
    outstanding: set[str] = field(default_factory=set)
    load: int = 0
    last_seen: float = 0.0
    refused: str | None = None  # why the last handshake was refused
    error: str | None = None
    connects: int = 0


@dataclass
class Pending:
    req: Req
    peer: PrefillPeer
    notifs: int = 0
    done: P.KVDone | None = None
    fenced: bool = False
    retries: int = 0
    sent_at: float = field(default_factory=time.monotonic)


class DecodeServer:
    def __init__(self, cfg: DecodeConfig, model_dir, model_name: str):
        self.cfg = cfg
        self.secret = cfg.resolved_secret()
        self.engine, self.point = build_engine(model_dir, cfg, role="decode", secret=self.secret, remote_prefill=True,
                                               max_model_len=cfg.max_model_len)
        self.model_name = model_name
        self.manifest = manifest(self.engine, self.point, "decode", model_name)
        self.layout = layout_of(self.engine)
        self.agent = self.engine.kv_agent()
        self.engine.on_schedule = self._dispatch
        self.engine.on_abort_transferring = self._fence
        self.engine.extra_owners = self._fenced_pages
        self.loop = EngineLoop(self.engine, cfg.max_requests, poll=self._poll)
        self.peers = [PrefillPeer(a) for a in cfg.prefill]
        self.pending: dict[str, Pending] = {}
        self.quarantine: list[tuple[float, list[int]]] = []  # (until, pages) after a lost peer
        self.aio: asyncio.AbstractEventLoop | None = None
        self.stats = {"handoffs": 0, "retried": 0, "failed": 0, "fenced": 0, "kv_pages_received": 0}

    @property
    def ready(self) -> bool:
        return any(p.healthy for p in self.peers)

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
            if peer.healthy or peer.chan is not None:
                self._lost(peer)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _connect(self, peer: PrefillPeer) -> None:
        host, port = peer.addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
        chan = P.Channel(reader, writer, self.secret, name=f"prefill@{peer.addr}")
        nonce = P.new_nonce()
        regions = [P.PoolRegion(base, self.engine.pool.num_pages) for base in self.agent.bases]
        await chan.send(P.Hello(self.manifest, self.agent.name, self.agent.metadata(), regions, nonce))
        reply = await asyncio.wait_for(chan.recv(), 10)
        if isinstance(reply, P.Refused):
            chan.close()
            if peer.refused != reply.reason:
                log.error("prefill %s refused the handshake: %s", peer.addr, reply.reason)
            peer.refused = reply.reason
            raise ConnectionError(f"refused: {reply.reason}")
        if not isinstance(reply, P.Welcome):
            chan.close()
            raise ConnectionError(f"unexpected {type(reply).__name__} in handshake")
        why = P.mismatch(self.manifest, reply.manifest)
        if why is not None:
            chan.close()
            if peer.refused != why:
                log.error("prefill %s does not match this decode server: %s", peer.addr, why)
            peer.refused = why
            raise ConnectionError(f"refused: {why}")
        chan.rekey(P.session_key(self.secret, nonce, reply.nonce))
        name = await self.loop.run_on_loop(lambda: self.agent.add_peer(reply.agent_meta))
        peer.chan, peer.agent_name, peer.manifest = chan, name, reply.manifest
        peer.refused, peer.error = None, None
        peer.healthy, peer.last_seen = True, time.monotonic()
        peer.connects += 1
        log.info("prefill %s handshaked (agent %s, tp=%d)", peer.addr, name, reply.manifest.tp)

    async def _serve_peer(self, peer: PrefillPeer) -> None:
        chan = peer.chan
        pinger = asyncio.create_task(self._pinger(peer))
        try:
            while True:
                msg = await asyncio.wait_for(chan.recv(), self.cfg.peer_timeout_s)
                peer.last_seen = time.monotonic()
                if isinstance(msg, P.KVDone):
                    self.loop.call(lambda m=msg: self._kv_done(m))
                elif isinstance(msg, P.Aborted):
                    self.loop.call(lambda m=msg: self._aborted(m.rid))
                elif isinstance(msg, P.PrefillFailed):
                    self.loop.call(lambda m=msg: self._prefill_failed(peer, m))
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

    # -- engine thread ------------------------------------------------------------------------------

    def _pick(self) -> PrefillPeer | None:
        live = [p for p in self.peers if p.healthy]
        return min(live, key=lambda p: (len(p.outstanding), p.load)) if live else None

    def _dispatch(self, batch: Batch) -> None:
        for req in batch.remote:
            self._send_prefill(req, retries=0)

    def _send_prefill(self, req: Req, retries: int) -> None:
        peer = self._pick()
        if peer is None:
            reasons = "; ".join(f"{p.addr}: {p.refused or p.error or 'connecting'}" for p in self.peers)
            self._fail(req, Unavailable(f"no prefill server available ({reasons})"))
            return
        skip = req.num_cached // self.point.page_size
        self.pending[req.rid] = Pending(req, peer, retries=retries)
        peer.outstanding.add(req.rid)
        self.stats["handoffs"] += 1
        self._send(peer, P.PrefillReq(req.rid, req.prompt_ids, req.params, skip, req.pages[skip:]))

    def _poll(self) -> bool:
        for _agent, msgs in self.agent.notifs().items():
            for m in msgs:
                rid, _, _ = m.decode(errors="replace").rpartition("|")
                p = self.pending.get(rid)
                if p is not None:
                    p.notifs += 1
                    self._check_ready(p)
        if self.quarantine:
            now = time.monotonic()
            keep = []
            for until, pages in self.quarantine:
                if until <= now:
                    self.engine.pool.unref(pages)
                else:
                    keep.append((until, pages))
            self.quarantine = keep
        return bool(self.pending)

    def _kv_done(self, m: P.KVDone) -> None:
        p = self.pending.get(m.rid)
        if p is None:
            return
        p.done = m
        self._check_ready(p)

    def _check_ready(self, p: Pending) -> None:
        if p.done is None or p.notifs < p.done.num_xfers or p.fenced:
            return
        del self.pending[p.req.rid]
        p.peer.outstanding.discard(p.req.rid)
        req, m = p.req, p.done
        self.stats["kv_pages_received"] += len(req.pages) - req.num_cached // self.point.page_size
        self.engine.scheduler.kv_arrived(req)
        self.engine.stats.prefill_tokens += m.computed_tokens
        out = self.engine.deliver(req, SampleOut(m.token, m.logprob, m.top_logprobs))
        self.loop._deliver(out)

    def _fence(self, req: Req) -> None:
        """Engine abort of a transferring request: keep its pages until prefill confirms."""
        p = self.pending.get(req.rid)
        if p is None or p.peer.chan is None:
            self.engine.release_fenced(req)
            self.pending.pop(req.rid, None)
            return
        p.fenced = True
        self.stats["fenced"] += 1
        self._send(p.peer, P.Abort(req.rid))

    def _aborted(self, rid: str) -> None:
        p = self.pending.pop(rid, None)
        if p is not None:
            p.peer.outstanding.discard(rid)
            self.engine.release_fenced(p.req)

    def _prefill_failed(self, peer: PrefillPeer, m: P.PrefillFailed) -> None:
        """Prefill gave up on it (and has nothing in flight for it): free, then retry or fail."""
        p = self.pending.pop(m.rid, None)
        if p is None:
            return
        peer.outstanding.discard(m.rid)
        if p.fenced:
            self.engine.release_fenced(p.req)
            return
        self.stats["failed"] += 1
        self._fail(p.req, Unavailable(f"prefill failed: {m.reason}"))

    def _peer_lost(self, peer: PrefillPeer) -> None:
        """Everything sent to it: target pages rest in quarantine (a write could still be on the wire),
        the rest is released; requests are retried on another peer or failed with 503."""
        if peer.agent_name:
            self.agent.remove_peer(peer.agent_name)
        for rid in list(peer.outstanding):
            p = self.pending.pop(rid, None)
            if p is None:
                continue
            req = p.req
            skip = req.num_cached // self.point.page_size
            self.quarantine.append((time.monotonic() + self.cfg.fence_s, req.pages[skip:]))
            req.pages = req.pages[:skip]
            if p.fenced:
                self.engine.release_fenced(req)
                continue
            self.engine.scheduler.transferring.pop(rid, None)
            self.engine.release_fenced(req)  # unlock the prefix, drop the cached pages' refs
            if p.retries < self.cfg.prefill_retries and self._pick() is not None:
                self.stats["retried"] += 1
                req.status = Status.WAITING
                req.num_cached = 0
                self.engine.scheduler.waiting.appendleft(req)
            else:
                self.stats["failed"] += 1
                self._fail(req, Unavailable(f"prefill server {peer.addr} was lost during the request"), release=False)
        peer.outstanding.clear()

    def _fail(self, req: Req, error: Exception, release: bool = True) -> None:
        """Take a request out of the engine and end its stream with an error."""
        sched = self.engine.scheduler
        if release:
            sched.transferring.pop(req.rid, None)
            self.engine.release_fenced(req)
        req.status, req.finish_reason = Status.FINISHED, "error"
        self.engine.streams.pop(req.rid, None)
        self.loop.fail(req.rid, error)

    def _fenced_pages(self) -> list[list[int]]:
        return [p.req.pages for p in self.pending.values() if p.fenced] + [pages for _, pages in self.quarantine]

    # -- inspection ---------------------------------------------------------------------------------

    def state_extra(self) -> dict:
        now = time.monotonic()
        return {
            "role": "decode",
            "point": self.point.name,
            "transfers": {
                "in_flight": [{"rid": rid, "peer": p.peer.addr, "notifs": p.notifs, "fenced": p.fenced,
                               "age_s": round(now - p.sent_at, 3)} for rid, p in self.pending.items()],
                "quarantined_pages": sum(len(pages) for _, pages in self.quarantine),
                **self.stats,
            },
            "peers": [{"addr": p.addr, "kind": "prefill", "healthy": p.healthy, "agent": p.agent_name,
                       "outstanding": len(p.outstanding), "load": p.load, "refused": p.refused, "error": p.error,
                       "connects": p.connects,
                       "last_seen_s": round(now - p.last_seen, 2) if p.last_seen else None} for p in self.peers],
        }


def run(cfg: DecodeConfig, reload_source=None) -> int:
    """Load, serve HTTP, wait for a prefill peer, warm up through it, READY; drain on SIGTERM."""
    from trnd.api.server import build_app
    from trnd.daemon.lifecycle import Lifecycle
    from trnd.engine.warmup import warm_up_loop
    from trnd.roles.runtime import http_server, run_async
    from trnd.model.maker import resolve_model

    with Lifecycle("decode", cfg, reload_source) as life:
        model_dir = resolve_model(cfg.model)
        name = cfg.served_model_name or model_dir.resolve().name
        life.status(f"loading {model_dir}")
        server = DecodeServer(cfg, model_dir, name)
        life.loop = server.loop
        app = build_app(server.loop, cfg, name, server.state_extra)
        st = app.state.trnd
        st.ready_fn = lambda: server.ready
        http = http_server(app, cfg.host, cfg.port, cfg.drain_timeout_s)

        def waiting() -> str:
            return "no prefill peer yet: " + "; ".join(f"{p.addr}: {p.refused or p.error or 'connecting'}"
                                                       for p in server.peers)

        st.not_ready_why = waiting

        async def main() -> int:
            await server.start()
            return await life.serve(
                http, st, banner=f"trnd: decode for {name} (point {cfg.point}, tp={cfg.tp}) on "
                                  f"http://{cfg.host}:{cfg.port}/v1, prefill peers {', '.join(cfg.prefill)}",
                ready_fn=lambda: server.ready, waiting=waiting, warmup=lambda: warm_up_loop(server.loop),
                in_flight=lambda: server.loop.num_requests, abort=st.abort_all)

        try:
            return run_async(main)
        finally:
            server.loop.stop()
            server.engine.close()
