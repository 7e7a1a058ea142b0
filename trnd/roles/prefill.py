"""`trnd prefill`: a KV factory. Decode servers connect over the control plane, send prompts, and get
the prompt's KV written straight into their page pools over NIXL, chunk by chunk, while the next
chunk computes; the last message carries the first token.

Threads: the asyncio loop owns the control-plane connections; the engine thread (EngineLoop) owns
the engine and the NIXL transfers. They talk through `loop.call` one way and
`run_coroutine_threadsafe` the other.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec

from trnd import snapshot as S
from trnd.config import PrefillConfig
from trnd.engine import trace
from trnd.engine.engine import LengthError
from trnd.engine.loop import EngineLoop
from trnd.engine.output import StepOutput
from trnd.engine.scheduler import Batch
from trnd.log import Failures
from trnd.roles.common import build_engine, layout_from, manifest, point_capacity
from trnd.transfer import digest
from trnd.transfer import protocol as wire
from trnd.transfer.handoff import Shipment, Shipped
from trnd.transfer.inflight import InFlight
from trnd.transfer.plan import by_segment, coalesce, make_plan, page_rows

log = logging.getLogger("trnd.prefill")


@dataclass
class Peer:
    """One connected decode server."""
    id: int
    chan: wire.Channel
    agent_name: str
    manifest: wire.Manifest
    regions: list[wire.PoolRegion]
    plan: list
    layout: object
    connected_at: float = field(default_factory=time.time)
    requests: int = 0
    bytes_sent: int = 0
    alive: bool = True


class PrefillServer:
    def __init__(self, cfg: PrefillConfig, model_dir, model_name: str):
        self.cfg = cfg
        self.admin_port: int | None = None  # set once bound (run): told to decode servers in the welcome
        self.secret = cfg.resolved_secret()
        # UCX listens where decode servers reach this role
        self.engine, self.point = build_engine(model_dir, cfg, role="prefill", secret=self.secret,
                                               bind_host=cfg.http.host)
        self.engine.publish_kv_events(cfg.kv_events, cfg.http.host)
        self.model_name = model_name
        self.manifest = manifest(self.engine, self.point, "prefill", model_name, cfg.engine.speculative_config)
        self.capacity = point_capacity(self.engine, self.point)
        self.layout = self.engine.layout
        self.agent = self.engine.agent
        self.memory = digest.Memory(self.engine.pools)
        self.engine.on_forward = self._ship
        self._names: dict[int, str] = {}  # peer id -> its decode agent (kept while its shipments settle)
        self._failed: list[str] = []  # local rids whose handoff failed mid-step: aborted by the next _poll
        self.loop = EngineLoop(self.engine, poll=self._poll, on_output=self._on_output)
        self.handoffs = Shipped()  # local rid -> what was shipped to which decode peer (transfer/handoff.py)
        self.inflight = InFlight(self.agent, "KV write")  # posted writes; their source pages held until they end
        self.peers: dict[int, Peer] = {}
        self._refusals: dict[str, Failures] = {}  # decode host -> its failed attempts (bounded log lines)
        self._ids = itertools.count(1)
        self.aio: asyncio.AbstractEventLoop | None = None
        # post_ms: time inside NIXL's post call; xfer_ms: post to completion seen, summed over transfers
        self.xfer_metrics = self.engine.xfer_metrics  # per decode agent: op kv_write
        self.metrics = None  # api/metrics.py Metrics of the admin app: each prefill's end is counted there
        self.stats = {"requests": 0, "xfers": 0, "bytes": 0, "descriptors": 0, "post_ms": 0.0, "xfer_ms": 0.0, "failed": 0,
                      "aborted": 0, "refused": 0, "unauthenticated": 0}

    # -- control plane (asyncio) --------------------------------------------------------------------

    async def serve(self, sock) -> asyncio.base_events.Server:
        """sock: the control port, bound at start (trnd.procs.bind_port)."""
        self.aio = asyncio.get_running_loop()
        self.loop.start()
        from trnd.procs import start_checked_server

        return await start_checked_server(self._on_conn, sock)

    async def _on_conn(self, reader, writer) -> None:
        """asyncio's server callback. A connection still open at shutdown is cancelled: that ends it, it is
        not an error (asyncio would log the CancelledError with a traceback at every clean stop)."""
        try:
            await self._serve_conn(reader, writer)
        except asyncio.CancelledError:
            writer.close()

    async def _serve_conn(self, reader, writer) -> None:
        addr = writer.get_extra_info("peername")
        chan = wire.Channel(reader, writer, self.secret, name=f"decode@{addr}")
        try:
            hello, challenge = await chan.challenge()
        except (wire.ChannelClosed, asyncio.TimeoutError, ConnectionError, OSError) as e:
            self.stats["unauthenticated"] += 1
            self._refused(addr, f"dropped before a valid Hello: {e}", logging.WARNING)
            chan.close()
            return
        if not isinstance(hello, wire.Hello):
            log.warning("%s: first message was %s, not Hello; closing", chan.name, type(hello).__name__)
            chan.close()
            return
        chan.session(hello.nonce, challenge)
        why = await self._claim(hello.agent_name)  # who it is, before what it is
        if why is None:
            why = wire.mismatch(self.manifest, hello.manifest)
        if why is None:
            try:
                plan = make_plan(self.layout, layout_from(hello.manifest))
            except ValueError as e:
                why = f"layout: prefill tp={self.manifest.tp}, decode tp={hello.manifest.tp}: {e}"
        agent_name = None
        if why is None:
            try:
                agent_name = self.agent.add_peer(hello.agent_meta)
            except Exception as e:  # NIXL could not parse it
                why = f"agent metadata refused by NIXL: {e}"
            else:
                if agent_name != hello.agent_name:
                    self.agent.remove_peer(agent_name)
                    why = f"agent metadata names {agent_name!r}, the Hello claims {hello.agent_name!r}"
        if why is not None:
            self.stats["refused"] += 1
            self._refused(addr, f"refused: {why}")
            try:
                await chan.send(wire.Refused(why))
            except (ConnectionError, OSError):
                pass
            chan.close()
            return
        peer = Peer(next(self._ids), chan, agent_name, hello.manifest, hello.regions, plan, layout_from(hello.manifest))
        gone = None  # why the connection ended (None: this process is stopping)
        self.peers[peer.id] = peer
        self._names[peer.id] = agent_name
        try:
            ev = self.engine.kv_events.publisher if self.engine.kv_events is not None else None
            await chan.send(wire.Welcome(self.manifest, self.agent.name, self.agent.metadata(), challenge,
                                         ev.endpoint if ev else None, ev.replay_endpoint if ev else None,
                                         self.admin_port))

            failures = self._refusals.pop(str(addr[0]) if addr else "?", None)
            log.info("decode server %s connected (agent %s, tp=%d ep=%d)%s", addr, agent_name, hello.manifest.tp,
                     hello.manifest.ep, (failures and failures.recovered()) or "")
            while True:
                msg = await chan.recv()
                if isinstance(msg, wire.PrefillReq):
                    self.loop.call(lambda m=msg: self._submit(peer, m))
                elif isinstance(msg, wire.Abort):
                    self.loop.call(lambda m=msg: self._abort(peer, m.rid))
                elif isinstance(msg, wire.Ping):
                    await chan.send(wire.Pong(msg.t, self.engine.load))
                else:
                    chan.reject(f"unexpected {type(msg).__name__}")
        except (wire.ChannelClosed, ConnectionError, OSError) as e:  # a reset shows up on send, too
            gone = f"{e}"
        finally:
            peer.alive = False
            chan.close()
            self.loop.call(lambda: self._peer_lost(peer, addr, gone))

    def _refused(self, addr, why: str, level: int = logging.ERROR) -> None:
        """A decode server that keeps retrying a refused handshake is a few lines, not one per attempt."""
        host = str(addr[0]) if addr else "?"
        if host not in self._refusals and len(self._refusals) >= 256:  # bounded, whoever connects
            self._refusals.pop(next(iter(self._refusals)))
        self._refusals.setdefault(host, Failures(log, f"decode server {host}", level)).failed(why)

    async def _claim(self, agent_name: str, wait_s: float = 5.0) -> str | None:
        """A decode agent is one peer at a time. Its earlier connection may be on its way out (the
        decode reconnected while this process was stopped): wait for that one's requests to settle, so
        that when Welcome goes out no write of the old session can still be posted; else refuse."""
        async def busy() -> list[int]:
            shipping = await self.loop.run_on_loop(self.handoffs.peers)  # the engine thread's books
            return sorted(pid for pid, name in list(self._names.items())
                          if name == agent_name and (pid in self.peers or pid in shipping))
        deadline = time.monotonic() + wait_s
        while await busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ids = await busy()
        if ids:
            return f"decode agent {agent_name!r} is already connected (peer {ids[0]})"
        return None

    def _send(self, peer: Peer, msg) -> None:
        """From the engine thread: queue a control message on the asyncio loop."""
        if peer.alive and self.aio is not None:
            asyncio.run_coroutine_threadsafe(self._send_safe(peer, msg), self.aio)

    async def _send_safe(self, peer: Peer, msg) -> None:
        try:
            await peer.chan.send(msg)
        except (ConnectionError, OSError) as e:
            log.warning("send to decode peer %d failed: %s", peer.id, e)

    # -- engine thread ------------------------------------------------------------------------------

    def _local(self, peer: Peer, rid: str) -> str:
        return f"p{peer.id}/{rid}"

    def _submit(self, peer: Peer, m: wire.PrefillReq) -> None:
        local = self._local(peer, m.rid)
        if self.handoffs.get(local) is not None:
            log.warning("duplicate PrefillReq for %s from peer %d rejected", m.rid, peer.id)
            return
        n_pages = -(-len(m.prompt_ids) // self.point.page_size)
        if len(m.dst_pages) != n_pages - m.skip_pages or m.skip_pages < 0:
            self._send(peer, wire.PrefillFailed(m.rid, f"dst_pages has {len(m.dst_pages)} pages for {n_pages} prompt "
                                                    f"pages with skip_pages = {m.skip_pages}"))
            return
        params = msgspec.structs.replace(m.params, max_tokens=1, stop=[])
        try:
            self.engine.add(m.prompt_ids, params, rid=local, session_id=m.session)
        except (LengthError, ValueError) as e:
            self._send(peer, wire.PrefillFailed(m.rid, str(e)))
            return
        if m.expires and time.time() >= m.expires:  # read late (this process was stopped): decode gave up
            self.engine.abort(local)
            self._send(peer, wire.PrefillFailed(m.rid, "the request reached prefill after its handoff deadline"))
            return
        self.handoffs.add(local, m.rid, peer.id, m.skip_pages, m.dst_pages, m.expires, started=time.monotonic())
        peer.requests += 1
        self.stats["requests"] += 1

    def _ship(self, batch: Batch) -> None:
        """After a forward: write the pages this chunk completed (one NIXL transfer per request chunk).
        The transfer runs on NIXL's progress thread while the engine computes the next chunk."""
        for req, n in batch.prefill:
            h = self.handoffs.get(req.rid)
            if h is None:
                continue
            idx = h.pages_ready(req.num_computed + n, req.num_prompt, self.point.page_size, self.cfg.pipeline)
            if not idx:
                continue
            peer = self.peers.get(h.peer)
            if peer is None or not peer.alive:
                self._fail(req.rid, h, "decode peer gone")
                continue
            if h.expired(time.time()):
                self._fail(req.rid, h, "handoff deadline passed before the KV was written")
                continue
            src = [req.pages[i] for i in idx]
            dst = [h.dst_pages[i - h.skip_pages] for i in idx]
            sd, dd = page_rows(peer.plan, self.layout, peer.layout, self.agent.bases,
                               [r.addr for r in peer.regions], src, dst)
            if h.hasher is None:
                h.hasher = digest.new()
            self.memory.update(h.hasher, sd)  # before the post: these pages are final, and held from here on
            sd, dd = coalesce(*by_segment(sd, dd, len(peer.plan)))
            t0 = time.monotonic()
            try:
                handle = self.agent.write(peer.agent_name, sd, dd, h.next_notif())
            except ConnectionError as e:
                self.xfer_metrics.failed("kv_write", peer.agent_name)
                self._fail(req.rid, h, str(e))
                continue
            self.stats["post_ms"] += (time.monotonic() - t0) * 1e3
            self.stats["descriptors"] += len(sd)
            nbytes = int(dd[:, 1].sum())
            self.xfer_metrics.start("kv_write", peer.agent_name)
            self.xfer_metrics.posted("kv_write", peer.agent_name, len(sd), nbytes)
            trace.phase(req, f"KV write {h.num_xfers} posted: {len(idx)} pages, {len(sd)} descriptors, "
                             f"{nbytes / 2**20:.1f} MiB to {peer.agent_name}")
            self.engine.hold(src)  # until the transfer is done, whatever happens to the request
            h.posted(idx, self.inflight.post(handle, src, nbytes, key=(req.rid, h.num_xfers, req), t0=t0), len(sd))

    def _on_output(self, out: StepOutput) -> None:
        if out.finished and self.metrics is not None:
            self.metrics.count_finished(out)
        h = self.handoffs.get(out.rid)
        if h is None or not out.finished or h.aborted:
            return
        if out.finish_reason == "abort":
            return
        lp = out.logprobs[0] if out.logprobs else None
        self._send_to(h.peer, wire.KVDone(h.rid, out.token_ids[0], lp.logprob if lp else None,
                                       [tuple(t) for t in lp.top] if lp else None, h.num_xfers,
                                       out.prompt_tokens - out.cached_tokens, out.cached_from or {},
                                       h.hasher.digest() if h.hasher is not None else b"", h.descriptors,
                                       time.monotonic() - h.t_start))
        h.finish()
        self._settle(out.rid)

    def _poll(self) -> bool:
        """Abort what failed during the last step, reap finished transfers (engine thread, every loop
        iteration, between steps)."""
        while self._failed:
            self.engine.abort(self._failed.pop())
        for x, ok in self.inflight.reap():
            local, n, req = x.key  # what _ship posted it with: the request's n-th write
            h = self.handoffs.get(local)
            h.ended(x)
            self.engine.drop(x.pages)
            self.xfer_metrics.end("kv_write", self._names.get(h.peer, "?"), x.nbytes, ok, t0=x.t0)
            if ok:
                trace.phase(req, f"KV write {n} done: {x.nbytes / 2**20:.1f} MiB in "
                                 f"{(time.monotonic() - x.t0) * 1e3:.1f} ms")
                self.stats["xfers"] += 1
                self.stats["bytes"] += x.nbytes
                self.stats["xfer_ms"] += (time.monotonic() - x.t0) * 1e3
                peer = self.peers.get(h.peer)
                if peer is not None:
                    peer.bytes_sent += x.nbytes
            else:
                self._fail(local, h, "NIXL transfer failed")
        for local in list(self.handoffs.by_local):
            self._settle(local)
        return bool(self.inflight)

    def _settle(self, local: str) -> None:
        """Forget a shipment that is over; an aborted one is answered `Aborted` (nothing in flight)."""
        h = self.handoffs.get(local)
        if h is not None and self.handoffs.settle(local) == "aborted":
            self._send_to(h.peer, wire.Aborted(h.rid))

    def _send_to(self, peer_id: int, msg) -> None:
        peer = self.peers.get(peer_id)
        if peer is not None:
            self._send(peer, msg)

    def _fail(self, local: str, h: Shipment, why: str) -> None:
        if not h.abort():
            return
        self.stats["failed"] += 1
        log.warning("prefill of %s for decode peer %d failed: %s", h.rid, h.peer, why)
        # Not engine.abort here: this may run inside a step (on_forward), whose postprocess still
        # delivers the request's output. The abort waits for the next _poll, between steps.
        self._failed.append(local)
        self._send_to(h.peer, wire.PrefillFailed(h.rid, why))

    def _abort(self, peer: Peer, rid: str) -> None:
        local = self._local(peer, rid)
        h = self.handoffs.get(local)
        if h is None:  # finished (or never seen): nothing is in flight for it
            self._send(peer, wire.Aborted(rid))
            return
        self.stats["aborted"] += 1
        self.engine.abort(local)
        h.abort()
        self._settle(local)

    def _peer_lost(self, peer: Peer, addr, why: str | None) -> None:
        """Engine thread: abort what it was sent (a decode server that stops cleanly has drained first:
        only a loss mid-request warns)."""
        mine = self.handoffs.of_peer(peer.id)
        if why is not None and mine:
            log.warning("decode server %s gone: %s; aborting its %d requests", addr, why, len(mine))
        elif why is not None:
            log.info("decode server %s disconnected (%s)", addr, why)
        for local in mine:
            self.engine.abort(local)
            self.handoffs.get(local).abort()
            self._settle(local)
        self.peers.pop(peer.id, None)
        self.agent.remove_peer(peer.agent_name)

    # -- inspection ---------------------------------------------------------------------------------

    def state_extra(self) -> dict:
        """prefill's part of /admin/state (trnd/snapshot.py)."""
        now = time.monotonic()
        return {
            "role": "prefill",
            "point": self.point.name,
            "capacity": S.Capacity(**{k: v for k, v in msgspec.structs.asdict(self.capacity).items() if k != "point"}),
            "transfers": S.Transfers(
                in_flight=[S.InFlight(rid=h.rid, peer=h.peer, xfers=len(h.xfers), sent_pages=h.sent_pages,
                                      age_s=round(now - min(x.t0 for x in h.xfers), 3))
                           for h in self.handoffs.by_local.values() if h.xfers], **self.stats),
            "peers": [S.Peer(id=p.id, kind="decode", agent=p.agent_name, tp=p.manifest.tp, ep=p.manifest.ep,
                             requests=p.requests,
                             bytes_sent=p.bytes_sent, healthy=p.alive,
                             connected_s=round(time.time() - p.connected_at, 1)) for p in self.peers.values()],
        }


def run(cfg: PrefillConfig, reload_source=None) -> int:
    """Load, warm up, serve the control plane and the admin HTTP port, READY; drain on SIGTERM."""
    from trnd.api.app import build_admin_app
    from trnd.daemon.lifecycle import Lifecycle
    from trnd.engine.warmup import warm_up
    from trnd.roles.runtime import http_server, run_async
    from trnd.model.hub import served_name
    from trnd.model.maker import resolve_model
    from trnd.procs import bind_port

    from trnd.transfer.backends import prepare

    prepare(cfg.engine.transfer_backend)  # a backend that cannot load here: one line, exit 78, before the load
    # Both ports before the load: another process on either is one line and exit 1 in a second.
    control = bind_port(cfg.http.host, cfg.control_port, "control_port")
    admin_sock = bind_port(cfg.http.host, cfg.http.admin_port, "admin_port")
    with Lifecycle("prefill", cfg, reload_source) as life:
        model_dir = resolve_model(cfg.model)
        name = served_name(model_dir)
        life.status(f"loading {model_dir}")
        server = PrefillServer(cfg, model_dir, name)
        server.admin_port = admin_sock.getsockname()[1]
        try:
            life.status("warming up")
            log.info("warm-up took %.2f s", warm_up(server.engine, max_tokens=1))
            life.loop = server.loop
            admin = build_admin_app(server.loop, cfg, name, server.state_extra)
            server.metrics = admin.state.trnd.metrics
            server.metrics.role_stats = lambda: {"prefill_requests": server.stats["requests"],
                                                 "prefill_kv_writes": server.stats["xfers"],
                                                 "prefill_kv_bytes": server.stats["bytes"],
                                                 "prefill_handoffs_failed": server.stats["failed"],
                                                 "prefill_handoffs_aborted": server.stats["aborted"]}
            http = http_server(admin, cfg.http, sock=admin_sock)

            async def main() -> int:
                ctrl = await server.serve(control)
                try:
                    return await life.serve(
                        http, admin.state.trnd, banner=f"trnd: prefill for {name} (point {cfg.point}, tp={cfg.engine.tp}) on "
                                            f"{cfg.http.host}:{cfg.control_port}, admin "
                                            f"http://{cfg.http.host}:{cfg.http.admin_port}",
                        in_flight=lambda: len(server.handoffs), on_drain=ctrl.close, also_listening=(ctrl,))
                finally:
                    ctrl.close()

            return run_async(main)
        finally:
            server.loop.stop()
            server.engine.close()
