"""`trnd compile`: a decode point's static graphs built ahead of time into a compile cache (trnd/compile_cache.py)."""

from __future__ import annotations

import time

import msgspec

from trnd.compile_cache import COMPILERS, MANIFEST, describe, use
from trnd.roles.common import build_engine


def run(args) -> int:
    """`trnd compile`: build the engine a role would build for the point (same pool, same shapes), compile
    every bucket, write the manifest."""
    from trnd.backends import get_backend
    from trnd.config import PrefillConfig, load_config
    from trnd.log import setup_logging
    from trnd.model.maker import resolve_model

    cfg = load_config(PrefillConfig, None, {
        "model": args.model, "point": args.point, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "backend": args.backend, "kv_memory_gb": args.kv_memory_gb, "threads": args.threads, "prefix_cache": False,
        "static": True})
    get_backend(cfg.engine.backend)  # a backend this host cannot run: one line, before anything loads
    setup_logging("warning")
    out = use(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(cfg.model)
    t0 = time.perf_counter()
    engine, point = build_engine(model_dir, cfg, role="compile", secret=None, bind_host=cfg.http.host,
                                 compiler=COMPILERS[cfg.engine.backend])
    try:
        engine.runner.warmup()
        loaded, compiled = engine.runner.counts()
        m = describe(engine, point, cfg.engine.backend)
        m.seconds = round(time.perf_counter() - t0, 1)
        (out / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(m)))
    finally:
        engine.close()
    print(f"trnd compile: point {point.name}, {len(m.graphs)} graphs ({compiled} compiled, {loaded} already in the "
          f"cache) for {model_dir} ({m.dtype}, {m.kv_pages} KV pages, {m.compiler}) in {m.seconds} s -> {out}")
    return 0
