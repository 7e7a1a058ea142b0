"""`trnd router`: probe the targets, serve HTTP, READY once a target is healthy; drain on SIGTERM.

Under systemd (`trnd@router`, Type=notify): READY=1 when the first target answers /ready, WATCHDOG=1
while the event loop turns, STOPPING=1 on SIGTERM, then requests in flight run to completion for up to drain_timeout_s. SIGHUP re-reads the
config and applies `targets`, `api_key(_file)`, `target_api_key(_file)` and `log_level` live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable

import httpx

from trnd.aio import within
from trnd.config import ConfigError, RouterConfig
from trnd.daemon import notify
from trnd.router.app import RouterState, build_app
from trnd.router.policy import PrefixIndex
from trnd.router.targets import Targets
from trnd.roles.runtime import http_server, run_async

log = logging.getLogger("trnd.router")


def run(cfg: RouterConfig, reload_source: Callable[[], RouterConfig] | None = None) -> int:
    if not cfg.targets:
        raise ConfigError("targets = []: the router needs at least one decode server (host:port) - at `$.targets`")
    tokenizer = None
    if cfg.model:
        from trnd.model.config import ModelError
        from trnd.model.tokenizer import Tokenizer
        from trnd.model.maker import resolve_model

        try:  # a missing or broken model directory: one line, exit 78 (cli.py), like the other roles
            tokenizer = Tokenizer.from_dir(resolve_model(cfg.model))
        except (OSError, ValueError) as e:
            raise ModelError(f"model = {cfg.model!r}: {e}") from None
    from trnd.procs import bind_port

    sock = bind_port(cfg.host, cfg.port, "port")  # another process on it: one line, exit 1
    return run_async(lambda: _main(cfg, tokenizer, reload_source, sock))


async def _main(cfg: RouterConfig, tokenizer, reload_source, sock) -> int:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        key = cfg.resolved_target_key() or cfg.resolved_api_key()
        targets = Targets(cfg.targets, client, probe_s=cfg.probe_s, probe_timeout_s=cfg.probe_timeout_s,
                          fail_after=cfg.fail_after, headers={"authorization": f"Bearer {key}"} if key else {})
        st = RouterState(cfg, client, targets, PrefixIndex(cfg.prefix_entries), tokenizer)
        app = build_app(st)
        http = http_server(app, cfg.host, cfg.port, cfg.drain_timeout_s, sock=sock)
        stop = asyncio.Event()
        aio = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio.add_signal_handler(sig, stop.set)
        aio.add_signal_handler(signal.SIGHUP, lambda: _reload(st, app, reload_source))
        probes = asyncio.create_task(targets.run(), name="trnd-router-probes")
        serving = asyncio.create_task(http.serve(), name="trnd-router-http")
        ready, pinged = False, 0.0
        wd = notify.watchdog_interval()
        while not stop.is_set():
            if wd is not None and time.monotonic() - pinged >= min(wd / 2, 10.0):  # the event loop turns
                notify.watchdog()
                pinged = time.monotonic()
            if serving.done():
                log.error("HTTP server stopped unexpectedly: %s", serving.exception() if not serving.cancelled()
                          else "cancelled")
                probes.cancel()
                return 1
            if not ready and http.started and targets.healthy():
                ready = True
                print(f"trnd: router on http://{cfg.host}:{cfg.port}/v1 for {', '.join(cfg.targets)}", flush=True)
                notify.ready(f"routing to {len(targets.healthy())} of {len(targets.all)} targets", http.listening())
            elif not ready:
                notify.status("waiting for a healthy target: " + "; ".join(
                    f"{t.addr}: {t.error or 'probing'}" for t in targets.all))
            with contextlib.suppress(asyncio.TimeoutError):
                await within(stop.wait(), 0.2)
        notify.stopping()
        st.draining = True
        deadline = time.monotonic() + cfg.drain_timeout_s
        while any(t.in_flight for t in targets.all) and time.monotonic() < deadline:
            notify.status(f"draining {sum(t.in_flight for t in targets.all)} requests")
            await asyncio.sleep(0.1)
        http.should_exit = True
        await serving
        probes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probes
        log.info("stopped")
        return 0


def _reload(st: RouterState, app, reload_source) -> None:
    if reload_source is None:
        log.warning("SIGHUP: this process was not started from a config it can re-read; nothing changed")
        return
    notify.reloading()
    try:
        new = reload_source()
    except ConfigError as e:
        log.error("reload refused, keeping the running config: %s", e)
        notify.ready("reload refused")
        return
    st.cfg = new
    st.targets.set_addrs(new.targets)
    key = new.resolved_target_key() or new.resolved_api_key()
    st.targets.headers = {"authorization": f"Bearer {key}"} if key else {}
    logging.getLogger().setLevel(new.log_level.upper())
    _swap_key(app, new.resolved_api_key())
    log.info("reloaded: targets %s", ", ".join(new.targets))
    notify.ready(f"reloaded: {len(new.targets)} targets")


def _swap_key(app, key: str | None) -> None:
    """Give the running API-key middleware the new key (Starlette builds the stack once, at start)."""
    from trnd.api.auth import APIKeyMiddleware

    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    node = app.middleware_stack
    while node is not None and not isinstance(node, APIKeyMiddleware):
        node = getattr(node, "app", None)
    if node is not None:
        node.expected = key.encode() if key else None
