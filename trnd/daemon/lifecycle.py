"""One role process's life under systemd (Type=notify), the same outside it: load, warm up, serve,
reload on SIGHUP, drain on SIGTERM.

    with Lifecycle("serve", cfg) as life:          # STATUS=loading, EXTEND_TIMEOUT_USEC every 10 s
        engine = ...; warm_up(engine)              # READY must mean "answers fast", not "is importing"
        life.loop = EngineLoop(engine).start()     # from now on the watchdog follows the engine loop
        return run_async(lambda: life.serve(http, app, banner=...))

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
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import msgspec

from trnd.config import ConfigError, load_config
from trnd.daemon import notify

log = logging.getLogger("trnd.daemon")

LOAD_EXTEND_S = 30.0  # each EXTEND_TIMEOUT_USEC while starting asks for this much more time
BEAT_MAX_S = 10.0  # heartbeat period when the watchdog is off (or slower than this)
MAX_START_S = 2 * 3600.0  # stop extending after this: a start that long is stuck; TimeoutStartSec fires
STOP_MARGIN_S = 30.0  # asked for beyond drain_timeout_s: abort the rest, close ranks, exit
ABORT_GRACE_S = 2.0  # after aborting, for the streams to write their error and close
SHUTDOWN_GRACE_S = 5.0  # uvicorn's wait for connections once requests are done
DEFAULT_DRAIN_S = 30.0
STALL_ENV = "TRND_DEBUG_STALL_S"  # test hook: EngineLoop.stall_s once ready (a hung loop on demand)

# What SIGHUP may change in a running process. Everything else (model, ports, point, tp, dtype, pool,
# secret, peers) is fixed by what was allocated or handshaked at start: logged as ignored.
LIVE_FIELDS = frozenset({"log_level", "max_requests", "max_n", "max_body_bytes", "api_key", "api_key_file",
                         "drain_timeout_s"})
_SECRET_FIELDS = frozenset({"api_key", "secret"})


def argv_source(role: str, cls: type, argv: list[str] | None = None) -> Callable[[], object] | None:
    """How to re-read this process's config: the command line it was started with, parsed again by the
    same parser (so flags keep overriding the file). None when argv is not a `trnd <role>` command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != role:
        return None
    from trnd.cli import build_parser

    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        return None
    flags = {k: v for k, v in vars(args).items() if k not in ("cmd", "config")}
    return lambda: load_config(cls, args.config, flags)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (a TP rank, or a role before exec): `sig` when its parent dies, even by SIGKILL, so no
    orphan keeps a node's memory or cores (PR_SET_PDEATHSIG; Linux only, nothing elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def warm_up(engine, max_tokens: int = 2) -> float:
    """One tiny greedy generation on the engine before its loop thread starts: the first forward pays
    for allocator growth, kernel selection and (on accelerators) compilation, which READY must not
    leave to the first client. The prompt is shorter than a page, so nothing lands in the prefix
    cache; the counters are reset so /metrics starts from zero. Returns the seconds it took."""
    from trnd.engine.request import SamplingParams

    t0 = time.perf_counter()
    ids = engine.tokenizer.encode("warm up", add_special_tokens=True)[:4] or [0]
    engine.add(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), rid="trnd-warmup")
    while engine.has_work:
        engine.step()
    # Then one full prefill chunk: the first chunk of a new size pays for the allocator and the kernels'
    # workspaces once (measured: a first 2048-token prefill 1.2 s, the next ones 0.56 s); its pages are
    # dropped from the prefix cache again.
    n = min(engine.cfg.chunk_size, engine.max_model_len - 2)
    if n > len(ids):
        vocab = engine.model_config.vocab_size
        tiers, engine.scheduler.tiers = engine.scheduler.tiers, None  # nothing of it goes to L2 or a store
        try:
            engine.add([3 + i % (vocab - 3) for i in range(n)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), rid="trnd-warmup-chunk")
            while engine.has_work:
                engine.step()
        finally:
            engine.scheduler.tiers = tiers
        engine.radix.reset()
        if tiers is not None:
            tiers.reset()  # what the reset just wrote back to L2
    engine.stats = type(engine.stats)()
    return time.perf_counter() - t0


async def warm_up_loop(loop, max_tokens: int = 2) -> None:
    """The same through a running EngineLoop (decode: the first token comes from a prefill peer, so
    this also proves the handoff path end to end)."""
    from trnd.engine.request import SamplingParams

    ids = loop.engine.tokenizer.encode("warm up", add_special_tokens=True)[:4] or [0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with contextlib.aclosing(loop.generate(ids, params, "trnd-warmup")) as outs:
        async for _ in outs:
            pass


def abort_requests(st) -> int:
    """End every in-flight API request with 503 (the client may retry elsewhere). Returns how many."""
    from trnd.engine.loop import Unavailable

    err = Unavailable("the server is shutting down")
    n = 0
    for rids in list(st.active.values()):
        for rid in rids:
            st.loop.fail(rid, err)
            n += 1
    return n


class Lifecycle:
    def __init__(self, role: str, cfg, reload_source: Callable[[], object] | None = None):
        """reload_source: returns the config re-read (default: parse sys.argv again, see argv_source)."""
        self.role = role
        self.cfg = cfg
        self.reload_source = reload_source if reload_source is not None else argv_source(role, type(cfg))
        self.phase = "loading"  # loading -> starting -> running -> stopping
        self.loop = None  # the EngineLoop once it exists: the watchdog follows its last_progress
        self.app = None
        self.in_flight: Callable[[], int] = lambda: 0
        self.watchdog_s = notify.watchdog_interval()
        self.started = time.monotonic()
        self.reloads = 0
        self._stops = 0
        self._stop_event: asyncio.Event | None = None
        self._auth = None
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
        notify.stopping(f"stopped by {signal.Signals(signum).name} while loading")
        log.info("%s while loading: exiting", signal.Signals(signum).name)
        raise SystemExit(0)

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

    async def serve(self, http, app=None, *, banner: str, ready_fn: Callable[[], bool] | None = None,
                    waiting: Callable[[], str] | None = None, warmup: Callable[[], Awaitable[None]] | None = None,
                    in_flight: Callable[[], int] | None = None, abort: Callable[[], int] | None = None,
                    on_drain: Callable[[], None] | None = None) -> int:
        """Serve `http` (runtime.HTTPServer) until SIGTERM/SIGINT, then drain. Returns the exit status.

        ready_fn: the role's own readiness (decode: a prefill peer handshaked); waiting: why not yet,
        for STATUS. warmup: coroutine run once ready_fn holds (retried until it succeeds). in_flight:
        requests the drain waits for; abort: fail them when drain_timeout_s is up. on_drain: stop
        taking new work that is not HTTP (prefill: close the control-plane listener)."""
        aio = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio.add_signal_handler(sig, self._on_stop, sig)
        aio.add_signal_handler(signal.SIGHUP, self._on_hup)
        self.app = app
        if in_flight is not None:
            self.in_flight = in_flight
        st = app.state.trnd if app is not None else None
        if st is not None:
            st.ready = False
            self._auth = _auth_middleware(app)
        self.phase = "starting"
        self.status("starting HTTP")
        task = asyncio.create_task(_serve_http(http), name="trnd-http")
        while not http.started:
            if task.done():
                return self._http_died(task)
            await asyncio.sleep(0.02)
        warmed = warmup is None
        while not self._stop_event.is_set():
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
            notify.ready(self.running_status())
            self._last_status = self.running_status()
        while not self._stop_event.is_set():
            if task.done():
                return self._http_died(task)
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

    async def _wait_stop(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), timeout)

    def _http_died(self, task: asyncio.Task) -> int:
        exc = task.exception()
        log.error("HTTP server stopped unexpectedly%s", f": {exc}" if exc else "")
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
        timeout = float(getattr(self.cfg, "drain_timeout_s", DEFAULT_DRAIN_S))
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
        changed = [f for f in old.__struct_fields__ if getattr(old, f) != getattr(new, f)]
        live = [f for f in changed if f in LIVE_FIELDS]
        ignored = [f for f in changed if f not in LIVE_FIELDS]
        merged = msgspec.structs.replace(old, **{f: getattr(new, f) for f in live})
        st = self.app.state.trnd if self.app is not None else None
        st_cfg, key = None, None
        if st is not None:  # everything that can fail (reading the key file) before anything changes
            st_cfg = msgspec.structs.replace(st.cfg, **{f: getattr(merged, f) for f in live
                                                        if f in st.cfg.__struct_fields__})
            key = st_cfg.resolved_api_key()
        self.cfg = merged
        if "log_level" in live:
            from trnd.log import setup_logging

            setup_logging(merged.log_level)
        if self.loop is not None and "max_requests" in live:
            self.loop.max_requests = merged.max_requests
        if st is not None:
            st.cfg = st_cfg
            if self._auth is not None:
                new_key = key.encode() if key else None
                if new_key != self._auth.expected:
                    live.append("api key")
                self._auth.expected = new_key
        log.debug("reload #%d: config re-read", self.reloads)
        for f in ignored:
            log.warning("reload: %s changed (%s -> %s) but needs a restart: ignored", f, _show(f, getattr(old, f)),
                        _show(f, getattr(new, f)))
        if live:
            log.info("reload: applied %s", ", ".join(f if f == "api key" else f"{f} = {_show(f, getattr(merged, f))}"
                                                    for f in live))
        else:
            log.info("reload: nothing to apply")
        return live, ignored


async def _serve_http(http) -> None:
    try:
        await http.serve()
    except SystemExit as e:  # uvicorn's way of saying it could not bind (it logged why)
        raise OSError(f"uvicorn could not start (exit {e.code})") from None


def _show(field: str, value) -> str:
    return "<hidden>" if field in _SECRET_FIELDS and value else repr(value)


def _auth_middleware(app):
    """The app's APIKeyMiddleware instance (so a reload can swap the key), building Starlette's
    middleware stack now rather than on the first request."""
    from trnd.api.auth import APIKeyMiddleware

    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    node = app.middleware_stack
    while node is not None:
        if isinstance(node, APIKeyMiddleware):
            return node
        node = getattr(node, "app", None)
    return None
