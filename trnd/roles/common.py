"""What the disaggregated roles share: the engine built from a decode point, the manifest, the layout."""

from __future__ import annotations

import logging
from pathlib import Path

from trnd_kernels.fp8 import SCALE_BYTES
from trnd.backends import resolve_dtype
from trnd.config import StartupError
from trnd.engine.build import EngineConfig, build
from trnd.engine.engine import Engine
from trnd.model.config import ModelConfig, fingerprint
from trnd.points import Capacity, DecodePoint, capacity, check_positions, get_point
from trnd.transfer.plan import Layout
from trnd.transfer.protocol import Manifest, PoolSpec

log = logging.getLogger("trnd.role")


def build_engine(model_dir: Path, cfg, *, role: str, secret: bytes | None, bind_host: str | None,
                 peers: list[str] = (), max_model_len: int | None = None,
                 compiler: str | None = None) -> tuple[Engine, DecodePoint]:
    """The engine of a disaggregated role (cfg: PrefillConfig or DecodeConfig), shaped by its point:
    page size, max context, max batch and prefill chunk come from the point, the pool from the
    memory budget; refuses to start if one max-context sequence cannot fit, or if the model is not
    configured for the point's max context (max_position_embeddings, or its rope scaling).
    static (or compile_cache): every step padded to the point's buckets (engine/static.py); with a
    compile cache (trnd/compile_cache.py) every bucket's graph is loaded from it before this returns.
    bind_host: the interface UCX listens on (None: the one toward `peers` and the stores)."""
    from trnd.transfer.nixl import bind_for

    knobs = cfg.engine
    bind_for(bind_host, [*peers, *cfg.tiers.store])
    point = get_point(cfg.point)
    cache = None
    if knobs.compile_cache is not None:
        from trnd import compile_cache

        cache = compile_cache.read(knobs.compile_cache)
        compile_cache.use(knobs.compile_cache)
        compiler = cache.compiler
    static = knobs.static or cache is not None
    num_pages = point_pool(point, model_dir, knobs, static)
    engine = Engine(build(EngineConfig.from_role(model_dir, knobs, cfg.tiers, role=role, point=point,
                                                 num_pages=num_pages, max_model_len=max_model_len, secret=secret,
                                                 compiler=compiler)))
    log.info(point_capacity(engine, point).line())
    if max_model_len is not None and max_model_len < point.max_context:
        log.info("point %s capped: max_model_len %d of its max_context %d", point.name, max_model_len,
                 point.max_context)
    if static and cache is None:
        log.info("static path without a compile cache: each bucket is compiled on its first use (`trnd compile` "
                 "builds them ahead; compile_cache loads them)")
    if cache is not None:
        try:
            compile_cache.load(engine, point, knobs.compile_cache, cache)
        except BaseException:
            engine.close()
            raise
    return engine, point


def point_pool(point: DecodePoint, model_dir: Path, knobs, static: bool) -> int:
    """The pages of a pool under `point` on one rank (knobs: a role's EngineKnobs: dtype, backend, tp,
    kv_cache_dtype, kv_memory_gb). StartupError, one line, when the model is not configured for the point's
    max context (max_position_embeddings, or its rope scaling) or one max-context sequence does not fit:
    `trnd serve` asks before any child starts (in either mode), and each role again."""
    from trnd.engine.runner import kv_page_bytes
    from trnd.parallel import TPGroup

    dtype, _ = resolve_dtype(knobs.dtype, knobs.backend)  # the pool's page bytes follow the computed dtype
    mc = ModelConfig.from_dir(model_dir, dtype)
    why = check_positions(point, mc.max_position_embeddings, mc.rope_scaling)
    if why is not None:  # positions the model was never configured for are not served silently
        raise StartupError(why)
    h0, h1 = TPGroup(0, knobs.tp).kv_heads(mc.pool.heads)
    page_bytes = kv_page_bytes(mc, h1 - h0, point.page_size, knobs.kv_cache_dtype)
    num_pages = int(knobs.kv_memory_gb * 2**30) // page_bytes
    need = point.pool_pages_needed() + static  # the static path's scratch page is never handed out
    if num_pages < need:
        raise StartupError(
            f"point {point.name!r} needs {need} pages of {point.page_size} tokens for one {point.max_context}-token "
            f"sequence ({need * page_bytes / 2**20:.1f} MiB per rank), but kv_memory_gb = {knobs.kv_memory_gb} holds "
            f"only {num_pages}: raise kv_memory_gb or pick a smaller point")
    return num_pages


def point_capacity(engine: Engine, point: DecodePoint) -> Capacity:
    """What this role's pool holds under its point: the point's batch shares the pool's tokens
    ("tokens, not sequences", docs/DEPLOY.md)."""
    return capacity(point, engine.runner.page_bytes, engine.pool.num_pages)


def manifest(engine: Engine, point: DecodePoint, role: str, model_name: str, speculative=None) -> Manifest:
    """speculative: the role's SpeculativeConfig (None: off), part of the contract on both sides."""
    mc = engine.model_config
    return Manifest(role=role, model_name=model_name, model_fingerprint=fingerprint(Path(engine.cfg.model)),
                    dtype=str(mc.dtype).removeprefix("torch."), num_layers=mc.num_layers,
                    num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, page_size=point.page_size,
                    point=point.name, max_context=point.max_context, max_batch=point.max_batch, tp=engine.tp.size,
                    ep=engine.tp.ep,
                    rank_heads=list(engine.layout.rank_heads), page_bytes=engine.runner.page_bytes,
                    kv_cache_dtype=engine.cfg.kv_cache_dtype, transfer_backend=engine.cfg.transfer_backend,
                    speculative_config={} if speculative is None else speculative.contract(),
                    pools=[pool_spec(engine.layout, engine.runner.kv_dtype)])


def pool_spec(lay: Layout, dtype: str) -> PoolSpec:
    """The pool's kind in the contract: its page as [layer, part, head, slot, width] (all heads: the canonical
    page), its dtype, and the bytes one token takes in it (values, fp8 scales aside)."""
    c = lay.canonical()
    heads = c.rank_heads[0][1]
    return PoolSpec(kind=lay.kind, dtype=dtype, layout=[lay.num_layers, lay.parts, heads, lay.page_size, lay.head_dim],
                    bytes_per_token=lay.num_layers * lay.parts * heads * lay.head_dim * lay.itemsize)


def layout_from(m: Manifest) -> Layout:
    scale_bytes = 0 if m.kv_cache_dtype == "auto" else SCALE_BYTES  # fp8 blocks end with their scale
    pool = m.pools[0] if m.pools else None  # a manifest from before pool kinds: K|V of num_kv_heads x head_dim
    parts, width, kind = (pool.layout[1], pool.layout[4], pool.kind) if pool else (2, m.head_dim, "gqa")
    blocks = m.num_layers * parts * (m.rank_heads[0][1] - m.rank_heads[0][0])
    itemsize = (m.page_bytes // blocks - scale_bytes) // (m.page_size * width)
    return Layout(m.num_layers, m.page_size, width, itemsize, tuple(tuple(h) for h in m.rank_heads),
                  scale_bytes, parts, kind)
