"""`trnd serve --aggregated`: one process owning the model, the scheduler and the API. `trnd serve` without
it is a local prefill + decode deployment (roles/local.py)."""

from __future__ import annotations

import logging

from trnd.config import ServeConfig
from trnd.model.hub import served_name
from trnd.model.maker import resolve_model

log = logging.getLogger("trnd.serve")


def run(cfg: ServeConfig, reload_source=None) -> int:
    """Load, warm up, serve until SIGTERM, drain; the daemon lifecycle is in trnd/daemon/lifecycle.py."""
    from trnd.api.server import build_app
    from trnd.daemon.lifecycle import Lifecycle
    from trnd.engine.build import EngineConfig, build
    from trnd.engine.engine import Engine
    from trnd.engine.loop import EngineLoop
    from trnd.engine.warmup import warm_up
    from trnd.procs import bind_port
    from trnd.roles.runtime import http_server, run_async

    if cfg.tiers.store:
        from trnd.transfer.backends import prepare

        prepare(cfg.engine.transfer_backend)  # a backend that cannot load here: one line, exit 78, before the load
    sock = bind_port(cfg.http.host, cfg.http.port, "port")  # another process on it: one line, exit 1, before the load
    with Lifecycle("serve", cfg, reload_source) as life:
        from trnd.transfer.nixl import bind_for

        bind_for(None, cfg.tiers.store)  # a store client's NIXL agent: on the interface toward its stores
        model_dir = resolve_model(cfg.model)
        life.status(f"loading {model_dir}")
        engine = Engine(build(EngineConfig.from_role(model_dir, cfg.engine, cfg.tiers, role="serve", shapes=cfg.shapes,
                                                     secret=cfg.resolved_secret_optional())))
        try:
            engine.publish_kv_events(cfg.kv_events, cfg.http.host)
            life.status("warming up")
            log.info("warm-up took %.2f s", warm_up(engine))
            loop = life.loop = EngineLoop(engine, cfg.api.max_requests).start()
            name = cfg.api.served_model_name or served_name(model_dir)
            app = build_app(loop, cfg, name)
            st = app.state.trnd
            log.info("engine ready: %s, %d KV pages of %d tokens, max context %d", name, engine.pool.num_pages,
                     cfg.shapes.page_size, engine.max_model_len)
            http = http_server(app, cfg.http, sock=sock)
            return run_async(lambda: life.serve(
                http, st, banner=f"trnd: serving {name} on http://{cfg.http.host}:{cfg.http.port}/v1",
                in_flight=lambda: loop.num_requests, abort=st.abort_all))
        finally:
            if life.loop is not None:
                life.loop.stop()
            engine.close()
