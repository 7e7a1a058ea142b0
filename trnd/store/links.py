"""The client's links to its stores: one connection task per store (connect, handshake, serve
replies, heartbeat, reconnect with backoff), and the request/reply and fire-and-forget sends over it.

`Links` is the half of StoreClient (store/client.py) that knows sockets; the other half knows pages.
It needs from the client: secret, manifest, agent, page_bytes, heartbeat_s, peer_timeout_s, _sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from trnd.aio import reconnect, within
from trnd.log import PEER_START_GRACE_S, Failures
from trnd.procs import dial
from trnd.store import protocol as store_wire

log = logging.getLogger("trnd.store.client")


class StoreDown(ConnectionError):
    """Not connected, refused, or skipped for a while after a timeout: a miss."""


@dataclass
class Store:
    addr: str
    key: bytes  # rendezvous seed
    chan: store_wire.StoreChannel | None = None
    welcome: store_wire.StoreWelcome | None = None
    peer: str | None = None  # the store's NIXL agent name
    healthy: bool = False
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    error: str | None = None
    refused: str | None = None
    connects: int = 0
    restarts: int = 0  # handshakes that found a new store_id (its cache was lost)
    slow_until: float = 0.0
    slow_backoff: float = 0.0
    failures: Failures = field(init=False)  # a store that stays away: a few lines, not one per retry
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("lookups", "hits", "misses", "pages_loaded", "bytes_in", "pages_stored", "pages_present", "bytes_out",
         "timeouts", "errors", "corrupt"), 0))

    def __post_init__(self):
        self.failures = Failures(log, f"store {self.addr}", grace_s=PEER_START_GRACE_S)


class Links:
    async def _store_task(self, s: Store) -> None:
        def failed(e: BaseException) -> None:
            s.error = str(e) or e.__class__.__name__
            if not s.healthy:  # connecting or handshaking (a loss once connected is _lost's line)
                s.failures.failed(s.error if s.refused else f"unreachable: {s.error}", absent=not s.refused)

        await reconnect(lambda: self._connect(s), lambda: self._serve(s), failed, lambda: self._lost(s))

    async def _connect(self, s: Store) -> None:
        host, port = s.addr.rsplit(":", 1)
        reader, writer = await dial(host, int(port), 2.0)
        chan = store_wire.StoreChannel(reader, writer, self.secret, name=f"store@{s.addr}")
        s.chan = chan
        await chan.answer(lambda n: store_wire.StoreHello(self.manifest, self.agent.name, n), 5.0)
        reply = await within(chan.recv(strict=True), 5.0)
        if isinstance(reply, store_wire.Refused):
            s.refused = reply.reason
            raise ConnectionError(f"refused this client: {reply.reason}")
        if not isinstance(reply, store_wire.StoreWelcome):
            raise ConnectionError(f"unexpected {type(reply).__name__} in the handshake")
        if reply.slot_bytes != self.page_bytes:
            s.refused = f"page_bytes: store slots hold {reply.slot_bytes} bytes, this client's page {self.page_bytes}"
            raise ConnectionError(s.refused)
        if s.welcome is not None and s.welcome.store_id != reply.store_id:
            s.restarts += 1
            log.warning("store %s restarted (its cached pages are gone)", s.addr)
        if s.peer != reply.agent_name:
            if s.peer is not None:
                self.agent.remove_peer(s.peer)
            s.peer = None
            s.peer = self.agent.add_peer(reply.agent_meta)
        s.welcome, s.refused, s.error = reply, None, None
        s.slow_until, s.slow_backoff = 0.0, 0.0
        s.healthy = True
        s.connects += 1
        log.info("store %s connected (%d slots of %d bytes)%s", s.addr, reply.num_slots, reply.slot_bytes,
                 s.failures.recovered() or "")

    async def _serve(self, s: Store) -> None:
        pinger = asyncio.create_task(self._pinger(s))
        try:
            while True:
                try:
                    msg = await within(s.chan.recv(), self.peer_timeout_s)
                except TimeoutError:
                    raise ConnectionError(f"no frame for {self.peer_timeout_s} s (heartbeat)") from None
                if isinstance(msg, store_wire.Pong):
                    continue
                fut = s.pending.pop(getattr(msg, "id", -1), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        finally:
            pinger.cancel()

    async def _pinger(self, s: Store) -> None:
        while True:
            await s.chan.send(store_wire.Ping(time.time()))
            await asyncio.sleep(self.heartbeat_s)

    def _lost(self, s: Store) -> None:
        if s.chan is not None:
            s.chan.close()
        s.chan, s.healthy = None, False
        for fut in s.pending.values():
            if not fut.done():
                fut.set_exception(StoreDown(f"store {s.addr} connection lost"))
        s.pending.clear()

    async def _request(self, s: Store, msg, timeout: float):
        """Send msg, wait for the reply with its id. StoreDown / TimeoutError on failure."""
        now = time.monotonic()
        if not s.healthy or s.chan is None or now < s.slow_until:
            raise StoreDown(f"store {s.addr} unavailable")
        if timeout <= 0:
            raise TimeoutError
        fut = asyncio.get_running_loop().create_future()
        s.pending[msg.id] = fut
        try:
            async with asyncio.timeout(timeout):
                await s.chan.send(msg)
                reply = await fut
        except TimeoutError:
            s.counters["timeouts"] += 1
            s.slow_backoff = min(max(2 * s.slow_backoff, 1.0), 30.0)
            s.slow_until = time.monotonic() + s.slow_backoff
            log.warning("store %s did not answer in %.2f s: skipped for %.0f s", s.addr, timeout, s.slow_backoff)
            raise
        except (ConnectionError, OSError) as e:
            raise StoreDown(str(e)) from None
        finally:
            s.pending.pop(msg.id, None)
        s.slow_backoff = 0.0
        if isinstance(reply, store_wire.Failed):
            s.counters["errors"] += 1
            raise StoreDown(f"store {s.addr}: {reply.reason}")
        return reply

    def _send_soon(self, s: Store, msg) -> None:
        """Fire and forget (releases, abandons, reports): never awaited by a call with a deadline."""
        chan = s.chan
        if chan is None:
            return

        async def send():
            try:
                await within(chan.send(msg), 5.0)
            except (ConnectionError, OSError, TimeoutError) as e:
                log.debug("send %s to %s: %s", type(msg).__name__, s.addr, e)

        task = asyncio.get_running_loop().create_task(send())
        self._sends.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._sends.discard)
