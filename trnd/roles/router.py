"""`trnd router`: probe the targets, serve HTTP, READY once a target is healthy; drain on SIGTERM.

The process's life is every role's (daemon/lifecycle.py): under systemd (`trnd@router`, Type=notify)
READY=1 once the first target answers /ready, WATCHDOG=1 while the event loop turns, STOPPING=1 on
SIGTERM, then requests in flight run to completion for up to drain_timeout_s. SIGHUP re-reads the
config and applies `targets`, `api_key(_file)`, `target_api_key(_file)` and `log_level` live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx

from trnd.config import ConfigError, RouterConfig
from trnd.router.app import RouterState, build_app, target_headers
from trnd.router.policy import PrefixIndex
from trnd.router.targets import Targets
from trnd.roles.runtime import http_server, run_async

log = logging.getLogger("trnd.router")


def run(cfg: RouterConfig, reload_source: Callable[[], RouterConfig] | None = None) -> int:
    from trnd.daemon.lifecycle import Beat, Lifecycle
    from trnd.procs import bind_port

    if not cfg.targets:
        raise ConfigError("targets = []: the router needs at least one decode server (host:port) - at `$.targets`")
    if cfg.kv_events and not cfg.model:
        raise ConfigError("kv_events = true routes on the prompt's token blocks: set model (the targets' model dir) "
                          "- at `$.model`")
    sock = bind_port(cfg.http.host, cfg.http.port, "port")  # another process on it: one line, exit 1
    with Lifecycle("router", cfg, reload_source) as life:
        tokenizer = _tokenizer(cfg) if cfg.model else None
        life.loop = Beat()
        return run_async(lambda: _main(life, cfg, tokenizer, sock))


def _tokenizer(cfg: RouterConfig):
    from trnd.model.config import ModelError
    from trnd.model.maker import resolve_model
    from trnd.model.tokenizer import Tokenizer

    try:  # a missing or broken model directory: one line, exit 78 (cli.py), like the other roles
        return Tokenizer.from_dir(resolve_model(cfg.model))
    except (OSError, ValueError) as e:
        raise ModelError(f"model = {cfg.model!r}: {e}") from None


async def _main(life, cfg: RouterConfig, tokenizer, sock) -> int:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        targets = Targets(cfg.targets, client, probe_s=cfg.probe_s, probe_timeout_s=cfg.probe_timeout_s,
                          fail_after=cfg.fail_after, headers=target_headers(cfg))
        from trnd.api.server import check_body

        st = RouterState(cfg=cfg, client=client, targets=targets, index=PrefixIndex(cfg.prefix_entries),
                         tokenizer=tokenizer, progress=life.loop, check_body=check_body)
        if cfg.kv_events:
            from trnd.router.events import PREFILL, EventRouting

            st.events = EventRouting()

            def on_state(t, state: dict) -> None:
                st.events.sync(t.addr, state.get("kv_events"))
                for p in state.get("peers") or []:  # a decode's prefill peers: the prefill leg's caches
                    if p.get("kind") == "prefill" and p.get("kv_events"):
                        st.events.sync(PREFILL + p["addr"], {"endpoint": p["kv_events"],
                                                            "replay_endpoint": p.get("kv_events_replay")})
            targets.on_state = on_state
        http = http_server(build_app(st), cfg.http, sock=sock)
        probes = asyncio.create_task(targets.run(), name="trnd-router-probes")
        try:
            return await life.serve(
                http, st,
                banner=f"trnd: router on http://{cfg.http.host}:{cfg.http.port}/v1 for {', '.join(cfg.targets)}",
                ready_fn=st.ready_fn, waiting=lambda: st.not_ready_why(), in_flight=st.in_flight)
        finally:
            if st.events is not None:
                st.events.close()
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
