"""`trnd serve`: the aggregated deployment, one process owning the model, the scheduler and the API."""

from __future__ import annotations

import logging
from pathlib import Path

from trnd.config import ServeConfig

log = logging.getLogger("trnd.serve")

PRESET_NAMES = ("tiny", "small")


def resolve_model(model: str | None) -> Path:
    """A model directory, or a preset name made on first use under the cache dir (nothing can be
    downloaded, so the embedded default is a random-weight model trnd makes itself)."""
    from trnd.model.maker import ensure_model

    if model is None or model in PRESET_NAMES:
        preset = model or "small"
        path = ensure_model(preset)
        log.info("model: preset %s at %s", preset, path)
        return path
    return Path(model)


def run(cfg: ServeConfig) -> int:
    import uvicorn

    from trnd.api.server import build_app
    from trnd.engine.engine import Engine, EngineConfig
    from trnd.engine.loop import EngineLoop

    model_dir = resolve_model(cfg.model)
    engine = Engine(EngineConfig(model=str(model_dir), dtype=cfg.dtype, backend=cfg.backend, page_size=cfg.page_size,
                                 num_pages=cfg.num_pages, kv_memory_gb=cfg.kv_memory_gb,
                                 max_model_len=cfg.max_model_len, max_batch=cfg.max_batch,
                                 token_budget=cfg.token_budget, chunk_size=cfg.chunk_size,
                                 prefix_cache=cfg.prefix_cache, threads=cfg.threads, tp=cfg.tp))
    loop = EngineLoop(engine, cfg.max_requests).start()
    name = cfg.served_model_name or model_dir.resolve().name
    app = build_app(loop, cfg, name)
    log.info("engine ready: %s, %d KV pages of %d tokens, max context %d", name, engine.pool.num_pages,
             cfg.page_size, engine.max_model_len)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, loop="uvloop", http="httptools",
                                           log_config=None, access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=int(cfg.drain_timeout_s) or None))
    print(f"trnd: serving {name} on http://{cfg.host}:{cfg.port}/v1", flush=True)
    try:
        server.run()
    finally:
        loop.stop()
        engine.close()
    return 0
