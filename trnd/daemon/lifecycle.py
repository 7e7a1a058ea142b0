"""One role process's life under systemd (Type=notify), the same outside it: load, warm up, serve,
reload on SIGHUP, drain on SIGTERM.

    with Lifecycle("serve", cfg, reload_source) as life:  # STATUS=loading, EXTEND_TIMEOUT_USEC every 10 s
        engine = ...; warm_up(engine)              # READY must mean "answers fast", not "is importing"
        life.loop = EngineLoop(engine).start()     # from now on the watchdog follows the engine loop
        return run_async(lambda: life.serve(http, app.state.trnd, banner=...))

The daemon knows no CLI, engine or API: it reads the two small contracts below (`Progress`, what the
watchdog follows; `Readiness`, what /ready shows) and calls the role's `reload` hook with the new config.

`serve` starts HTTP first (so /health answers while a decode server waits for its prefill peers),
then waits for the role's own readiness, warms up what needs the loop, and only then flips /ready
to 200 and sends READY=1. The watchdog pings (WATCHDOG=1 every WATCHDOG_USEC/2) only while the
engine loop came round within the last WATCHDOG_USEC, so a hung step stops them and systemd restarts
the unit. SIGTERM: STOPPING=1, /ready and new requests 503, in-flight requests run to completion for
up to drain_timeout_s, the rest fail with 503, exit 0. SIGHUP: RELOADING=1, re-read the config the
process was started with (same file, same flags), apply what can change live, log the rest as
ignored until restart, READY=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from trnd import config
from trnd.config import ConfigError
from trnd.daemon import notify

log = logging.getLogger("trnd.daemon")

LOAD_EXTEND_S = 30.0  # each EXTEND_TIMEOUT_USEC while starting asks for this much more time
BEAT_MAX_S = 10.0  # heartbeat period when the watchdog is off (or slower than this)
MAX_START_S = 2 * 3600.0  # stop extending after this: a start that long is stuck; TimeoutStartSec fires
STOP_MARGIN_S = 30.0  # asked for beyond drain_timeout_s: abort the rest, close ranks, exit
ABORT_GRACE_S = 2.0  # after aborting, for the streams to write their error and close
SHUTDOWN_GRACE_S = 5.0  # uvicorn's wait for connections once requests are done
STALL_ENV = "TRND_DEBUG_STALL_S"  # test hook: EngineLoop.stall_s once ready (a hung loop on demand)

# What SIGHUP may change in a running process. Everything else (model, ports, point, tp, dtype, pool,
# secret, peers) is fixed by what was allocated or handshaked at start: logged as ignored.
LIVE_FIELDS = frozenset({"log_level", "max_requests", "max_n", "max_body_bytes", "api_key", "api_key_file",
                         "drain_timeout_s", "targets", "target_api_key", "target_api_key_file"})
_SECRET_FIELDS = frozenset({"api_key", "target_api_key", "secret"})
BEAT_TICK_S = 0.5  # how often an asyncio-only role's Beat is turned


class Progress(Protocol):
    """What the watchdog follows (engine/loop.py EngineLoop): a crash, or a loop that stopped coming round."""
    error: BaseException | None
    last_progress: float


class Beat:
    """The Progress of a role whose work all runs on its asyncio loop (router, store): `serve` turns it
    while that loop comes round, so a blocked loop stops the watchdog as a hung engine step does."""

    def __init__(self):
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()


class Readiness(Protocol):
    """What /ready shows (trnd/http/admin.py Readiness). `reload(cfg, live)` checks the live fields of a re-read
    config and returns the function that applies them (so a bad key file changes nothing); it returns
    the names of what it changed beyond the fields ("api key")."""
    ready: bool
    draining: bool

    def reload(self, cfg, live: list[str]) -> Callable[[], list[str]]: ...


class Lifecycle:
    def __init__(self, role: str, cfg, reload_source: Callable[[], object] | None):
        """reload_source: returns the config re-read (cli.py: the same file and flags); None: cannot reload."""
        self.role = role
        self.cfg = cfg
        self.reload_source = reload_source
        self.phase = "loading"  # loading -> starting -> running -> stopping
        self.loop: Progress | None = None  # the EngineLoop once it exists: the watchdog follows it
        self.state: Readiness | None = None
        self.in_flight: Callable[[], int] = lambda: 0
        self.watchdog_s = notify.watchdog_interval()
        self.started = time.monotonic()
        self.reloads = 0
        self._stops = 0
        self._stop_event: asyncio.Event | None = None
        self._last_status = ""
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None

    # -- process-wide setup (main thread) -----------------------------------------------------------

    def __enter__(self) -> "Lifecycle":
        faulthandler.enable(all_threads=True)  # a watchdog SIGABRT leaves every thread's stack in the journal
        signal.signal(signal.SIGTERM, self._stop_while_loading)
        signal.signal(signal.SIGINT, self._stop_while_loading)
        signal.signal(signal.SIGHUP, self._hup_while_loading)
        self.status(f"loading {self.role}")
        if notify.enabled():
            self.beat()
            self._beat_thread = threading.Thread(target=self._beat_forever, name="trnd-heartbeat", daemon=True)
            self._beat_thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._beat_stop.set()
        if exc is not None and not isinstance(exc, SystemExit):
            self.status(f"failed: {type(exc).__name__}: {exc}")

    def _stop_while_loading(self, signum, frame) -> None:
        """Nothing to drain yet: unwind and exit 0. Once only: a second signal (a supervisor's forwarded
        SIGTERM, then its death signal) must not raise again inside the cleanup the first one runs, where
        it would end as a traceback ("Exception ignored in ...")."""
        name = signal.Signals(signum).name
        if self._stops:
            log.debug("%s while already stopping: ignored", name)
            return
        self._stops += 1
        notify.stopping(f"stopped by {name} while loading")
        log.info("%s while loading: exiting", name)
        raise SystemExit(130 if signum == signal.SIGINT else 0)  # Ctrl-C's status, as a shell reports it

    def _hup_while_loading(self, signum, frame) -> None:
        log.warning("SIGHUP while loading: ignored (reload once the server is ready)")

    def status(self, text: str) -> None:
        log.debug("status: %s", text)
        self._last_status = text
        notify.status(text)

    # -- heartbeat thread ---------------------------------------------------------------------------

    def _beat_forever(self) -> None:
        period = min(self.watchdog_s / 2, BEAT_MAX_S) if self.watchdog_s else BEAT_MAX_S
        while not self._beat_stop.wait(period):
            try:
                self.beat()
            except Exception:  # a heartbeat must never take the process down
                log.exception("heartbeat failed")

    def alive(self, now: float | None = None) -> bool:
        """Whether the watchdog may be fed: while loading, the process is all there is to watch; once
        the engine loop runs, it must have come round within one watchdog period."""
        loop = self.loop
        if loop is None:
            return self.phase in ("loading", "starting")
        if loop.error is not None:
            return False
        limit = self.watchdog_s or BEAT_MAX_S
        return (time.monotonic() if now is None else now) - loop.last_progress < limit

    def beat(self) -> None:
        now = time.monotonic()
        if self.phase in ("loading", "starting") and now - self.started < MAX_START_S:
            notify.extend_timeout(LOAD_EXTEND_S)
        if self.watchdog_s and self.alive(now):
            notify.watchdog()
        if self.phase == "running":
            text = self.running_status()
            if text != self._last_status:
                self.status(text)

    def running_status(self) -> str:
        return f"ready: {self.in_flight()} requests in flight"

    # -- serving ------------------------------------------------------------------------------------

    async def serve(self, http, state: Readiness | None = None, **kw) -> int:
        """_serve, with the Beat of an asyncio-only role (self.loop) turned while this loop runs."""
        turner = asyncio.create_task(self._turn(self.loop), name="trnd-beat") if isinstance(self.loop, Beat) else None
        try:
            return await self._serve(http, state, **kw)
        finally:
            if turner is not None:
                turner.cancel()

    async def _serve(self, http, state: Readiness | None = None, *, banner: str,
                     ready_fn: Callable[[], bool] | None = None, waiting: Callable[[], str] | None = None,
                     warmup: Callable[[], Awaitable[None]] | None = None, in_flight: Callable[[], int] | None = None,
                     abort: Callable[[], int] | None = None, on_drain: Callable[[], None] | None = None,
                     also_listening: tuple = ()) -> int:
        """Serve `http` (runtime.HTTPServer) until SIGTERM/SIGINT, then drain. Returns the exit status.

        ready_fn: the role's own readiness (decode: a prefill peer handshaked); waiting: why not yet,
        for STATUS. warmup: coroutine run once ready_fn holds (retried until it succeeds). in_flight:
        requests the drain waits for; abort: fail them when drain_timeout_s is up. on_drain: stop
        taking new work that is not HTTP (prefill: close the control-plane listener). also_listening:
        the role's other servers (asyncio.Server: prefill's and the store's control plane), reported
        with READY beside the HTTP port."""
        aio = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio.add_signal_handler(sig, self._on_stop, sig)
        aio.add_signal_handler(signal.SIGHUP, self._on_hup)
        self.state = st = state
        if in_flight is not None:
            self.in_flight = in_flight
        if st is not None:
            st.ready = False
        self.phase = "starting"
        self.status("starting HTTP")
        task = asyncio.create_task(_serve_http(http), name="trnd-http")
        while not http.started:
            if task.done():
                return self._http_died(task, http)
            await asyncio.sleep(0.02)
        warmed = warmup is None
        while not self._stop_event.is_set():
            if task.done():  # lost its port (runtime.HTTPServer.startup) or died while the role waited
                return self._http_died(task, http)
            if ready_fn is not None and not ready_fn():
                self.status(f"waiting: {waiting() if waiting else 'not ready'}")
                await self._wait_stop(0.2)
                continue
            if warmed:
                break
            self.status("warming up")
            try:
                await warmup()
                warmed = True
            except Exception as e:
                log.warning("warm-up failed (%s: %s); retrying", type(e).__name__, e)
                await self._wait_stop(1.0)
        if not self._stop_event.is_set():
            if st is not None:
                st.ready = True
            self._debug_stall()
            self.phase = "running"
            print(banner, flush=True)
            log.info("ready after %.1f s", time.monotonic() - self.started)
            # What it listens on goes with READY: a supervisor (trnd serve, roles/local.py) counts only its
            # own child as up, never another process that answers on the same port.
            notify.ready(self.running_status(), listening(http, also_listening))
            self._last_status = self.running_status()
        while not self._stop_event.is_set():
            if task.done():
                return self._http_died(task, http)
            if self.loop is not None and self.loop.error is not None:
                log.error("engine loop crashed: exiting so that the service manager restarts this role")
                self.status("failed: engine loop crashed")
                http.should_exit = True
                await task
                return 1
            await self._wait_stop(1.0)
        await self.drain(st, abort, on_drain)
        http.config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S
        http.should_exit = True
        await task
        log.info("stopped")
        return 0

    @staticmethod
    async def _turn(beat: Beat) -> None:
        while True:
            beat.last_progress = time.monotonic()
            await asyncio.sleep(BEAT_TICK_S)

    async def _wait_stop(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancellation (trnd/aio.py)
                await self._stop_event.wait()

    def _http_died(self, task: asyncio.Task, http) -> int:
        """E.g. listen() on the port bound at start lost it to another process in between: one line
        naming the port, exit 1 (a restart may find it free)."""
        exc = task.exception()
        port = getattr(getattr(http, "config", None), "port", "?")
        log.error("HTTP server on port %s stopped unexpectedly%s", port, f": {exc}" if exc else "")
        self.status("failed: HTTP server stopped")
        return 1

    def _debug_stall(self) -> None:
        value = os.environ.get(STALL_ENV)
        if not value or self.loop is None:
            return
        try:
            self.loop.stall_s = float(value)
        except ValueError:
            log.warning("%s=%r is not a number: ignored", STALL_ENV, value)
            return
        log.warning("%s: every engine step now sleeps %s s (test hook)", STALL_ENV, value)

    # -- SIGTERM: drain -----------------------------------------------------------------------------

    def _on_stop(self, sig: int) -> None:
        self._stops += 1
        name = signal.Signals(sig).name
        if self._stops == 1:
            log.info("%s: draining", name)
        else:
            log.warning("%s again: not waiting for in-flight requests any longer", name)
        self._stop_event.set()

    async def drain(self, st=None, abort: Callable[[], int] | None = None,
                    on_drain: Callable[[], None] | None = None) -> int:
        """Stop taking work, let in-flight requests finish (up to drain_timeout_s), fail the rest.
        Returns how many were aborted."""
        timeout = self.cfg.http.drain_timeout_s
        self.phase = "stopping"
        n = self.in_flight()
        notify.stopping(f"draining {n} requests (up to {timeout:g} s)")
        notify.extend_timeout(timeout + STOP_MARGIN_S)  # a drain_timeout_s beyond TimeoutStopSec still holds
        if st is not None:
            st.draining = True
        if on_drain is not None:
            on_drain()
        log.info("draining: %d requests in flight, waiting up to %g s", n, timeout)
        deadline = time.monotonic() + timeout
        while self.in_flight() and time.monotonic() < deadline and self._stops < 2:
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if not left:
            log.info("drained")
            return 0
        log.warning("drain: %d requests still running: aborting them", left)
        notify.status(f"aborting {left} requests")
        aborted = abort() if abort is not None else 0
        end = time.monotonic() + ABORT_GRACE_S
        while self.in_flight() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return aborted

    # -- SIGHUP: reload -----------------------------------------------------------------------------

    def _on_hup(self) -> None:
        if self.phase != "running":
            log.warning("SIGHUP while %s: ignored", self.phase)
            return
        self.reload()

    def reload(self) -> bool:
        """Re-read the config and apply what can change live. A bad file changes nothing."""
        notify.reloading("reloading configuration")
        self.reloads += 1
        try:
            if self.reload_source is None:
                raise ConfigError("cannot reload: this process was not started as `trnd "
                                  f"{self.role}` so its config source is unknown")
            self.apply(self.reload_source())
        except (ConfigError, OSError, ValueError) as e:
            log.error("reload failed, keeping the running configuration: %s", str(e).replace("\n", " "))
            notify.ready(f"{self.running_status()}; last reload failed: {e}")
            return False
        notify.ready(self.running_status())
        self._last_status = self.running_status()
        return True

    def apply(self, new) -> tuple[list[str], list[str]]:
        """Apply the live fields of `new`; returns (applied, ignored) field names."""
        old = self.cfg
        if type(new) is not type(old):
            raise ConfigError(f"reload produced a {type(new).__name__}, not a {type(old).__name__}")
        was, now = config.flat(old), config.flat(new)
        changed = [f for f in was if was[f] != now[f]]
        live = [f for f in changed if f in LIVE_FIELDS]
        ignored = [f for f in changed if f not in LIVE_FIELDS]
        merged = config.replace(old, {f: now[f] for f in live})
        # Everything that can fail (reading the key file) before anything changes.
        commit = self.state.reload(merged, live) if self.state is not None else None
        self.cfg = merged
        if "log_level" in live:
            from trnd.log import setup_logging

            setup_logging(merged.log_level, self.role)
        if self.loop is not None and "max_requests" in live:
            self.loop.max_requests = now["max_requests"]
        if commit is not None:
            live += commit()
        log.debug("reload #%d: config re-read", self.reloads)
        for f in ignored:
            log.warning("reload: %s changed (%s -> %s) but needs a restart: ignored", f, _show(f, was[f]),
                        _show(f, now[f]))
        if live:
            log.info("reload: applied %s", ", ".join(f if f == "api key" else f"{f} = {_show(f, now[f])}"
                                                    for f in live))
        else:
            log.info("reload: nothing to apply")
        return live, ignored


def listening(http, servers=()) -> list[str]:
    """host:port of every socket `http` (runtime.HTTPServer) and `servers` (asyncio.Server) listen on."""
    socks = [s for srv in [*getattr(http, "servers", []), *servers] for s in (srv.sockets or [])]
    return [":".join(map(str, s.getsockname()[:2])) for s in socks]


async def _serve_http(http) -> None:
    try:
        await http.serve()
    except SystemExit as e:  # uvicorn's way of saying it could not bind (it logged why)
        raise OSError(f"uvicorn could not start (exit {e.code})") from None


def _show(field: str, value) -> str:
    return "<hidden>" if field in _SECRET_FIELDS and value else repr(value)
