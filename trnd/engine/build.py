"""Assembling an engine: `build(cfg) -> Parts`, everything `Engine` steps over, made once at start.

The model and tokenizer, one KV pool per TP rank (in shared memory with TP, so this process reaches
them all) and the rank processes (engine/workers.py), the page pool, the radix cache and the scheduler
over them, the runner (eager, static: engine/static.py, or with compiled decode steps:
engine/compiled.py), the NIXL agent and the KV layout it moves, the page-hash namespace, the tiers
(L2 host DRAM under the node's budget, L3 stores through their client) and the core lock. `Engine`
(engine.py) keeps the requests: add, abort, step, deliver.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from trnd.backends import get_backend, resolve_dtype
from trnd.backends.cpu import cpu_paths, describe, kernels_status
from trnd.cache.budget import NodeBudget
from trnd.cache.host import HostTier
from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache
from trnd.cache.tiers import Tiers
from trnd.config import EngineKnobs, Shapes, StartupError, TierConfig, engine_conflict
from trnd.engine.corelock import CoreLock
from trnd.engine.runner import ModelRunner, alloc_kv, kv_page_bytes, pool_layout
from trnd.engine.scheduler import Scheduler, SchedulerConfig
from trnd.model.config import ModelConfig, fingerprint, weights_identity
from trnd.model.loader import load_model
from trnd.model.moe import check_split
from trnd.model.tokenizer import Tokenizer
from trnd.parallel import TPGroup
from trnd.transfer.metrics import TransferMetrics
from trnd.transfer.plan import Layout

log = logging.getLogger("trnd.engine")

NIXL_ROLES = ("prefill", "decode")  # roles whose pools another process reads or writes over NIXL


@dataclass
class EngineConfig:
    model: str
    dtype: str | None = None  # None or "auto": the backend picks (trnd/backends: pick_dtype)
    kv_cache_dtype: str = "auto"  # auto: KV in the model dtype; fp8_e4m3 | fp8_e5m2: fp8 pages (kernels/fp8.py)
    backend: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None  # None: derived from kv_memory_gb
    kv_memory_gb: float = 1.0
    max_model_len: int | None = None  # None: min(model's max positions, what the pool holds)
    max_batch: int = 32
    token_budget: int = 512
    chunk_size: int = 512
    prefix_cache: bool = True
    seed: int | None = None  # for unseeded sampling (tests)
    threads: int | None = None
    tp: int = 1  # tensor-parallel ranks (processes) for this engine
    ep: int = 1  # expert-parallel groups of those ranks (trnd/parallel.py); divides tp
    host_cache_gb: float = 0.0  # L2 host-DRAM tier for evicted prefix pages; 0: off
    host_policy: str = "write-back"  # or write-through
    node_host_memory_gb: float | None = None  # node-wide budget shared with other trnd processes; None: no check
    store: list[str] = field(default_factory=list)  # L3: remote KV stores (host:port); [] = off
    store_secret: bytes | None = None  # control-plane secret the stores share
    store_on_finish: bool = True  # write a finished request's full pages to L3 (the next turn finds them)
    store_deadline_s: float = 1.0  # a store slower than this is a miss
    role: str = "serve"  # names this process's NIXL agent; prefill and decode always have one
    static: bool = False  # pad steps to the point's shape buckets, compiled per bucket (engine/static.py)
    point: str | None = None  # decode point whose buckets the static path uses; None: derived from this config
    compiler: str | None = None  # the static path's torch.compile backend; None: static.COMPILERS for the device
    core_lock: str | None = None  # a file the roles sharing this node's cores lock per forward (engine/corelock.py)
    transfer_backend: str = "ucx"  # the NIXL backend of this process's agent (transfer/backends.py)
    remote: object = None  # config.RemoteConfig: the L3 backend (Mooncake: store/mooncake.py); None: `store`
    speculative: object = None  # config.SpeculativeConfig: speculative decoding (engine/spec/); None: one token a step
    compile_decode: bool = False  # decode-only steps through one inductor graph (engine/compiled.py); CPU

    def __post_init__(self):
        bad = engine_conflict(static=self.static, compile_cache=None, compile_decode=self.compile_decode, tp=self.tp,
                              backend=self.backend, kv_cache_dtype=self.kv_cache_dtype, ep=self.ep)
        if bad is not None:
            raise ValueError(bad[1])

    @classmethod
    def from_role(cls, model_dir, knobs: EngineKnobs, tiers: TierConfig, *, role: str, shapes: Shapes | None = None,
                  point=None, num_pages: int | None = None, max_model_len: int | None = None,
                  secret: bytes | None = None, compiler: str | None = None) -> "EngineConfig":
        """The engine a role's config asks for: its engine knobs and tiers (config.py) as given; the step
        shapes from its decode point (trnd/points.py), or, for the aggregated server, its own `shapes`. A
        compile cache means the static path (its graphs are the point's buckets)."""
        static = knobs.static or knobs.compile_cache is not None
        if point is not None:
            dims = dict(page_size=point.page_size, num_pages=num_pages, max_batch=point.max_batch,
                        max_model_len=max_model_len or point.max_context, token_budget=point.prefill_chunk,
                        chunk_size=point.prefill_chunk, point=point.name if static else None)
        else:
            dims = msgspec.structs.asdict(shapes or Shapes())
        engine = {k: v for k, v in msgspec.structs.asdict(knobs).items() if k != "compile_cache"}
        spec = engine.pop("speculative_config")
        # prefill samples no decode step: no drafts and no draft model (its config's is only the contract)
        return cls(model=str(model_dir), **{**engine, "static": static}, speculative=None if role == "prefill" else spec,
                   **{**msgspec.structs.asdict(tiers), "store": list(tiers.store)}, store_secret=secret, role=role,
                   compiler=compiler, **dims)


@dataclass(eq=False)
class Parts:
    """What an Engine is made of (build() makes them; a test may hand in its own)."""
    cfg: EngineConfig  # with the dtype resolved
    model_config: ModelConfig
    tokenizer: Tokenizer
    model: torch.nn.Module
    tp: TPGroup
    pools: list[torch.Tensor]  # one KV pool per rank
    workers: object | None  # engine/workers.py WorkerGroup: ranks 1..N-1 (tp > 1)
    pool: PagePool
    radix: RadixCache
    scheduler: Scheduler
    runner: ModelRunner  # or engine/static.py StaticRunner
    max_model_len: int
    namespace: str
    layout: Layout
    xfer_metrics: TransferMetrics
    scratch_page: int | None = None  # the static path's padding page, never handed out
    agent: object | None = None  # transfer/nixl.py KVAgent with every rank's pool registered
    tiers: Tiers | None = None
    budget: NodeBudget | None = None
    core_lock: CoreLock | None = None
    kernels: object | None = None  # backends/cpu.py kernels_status: the compiled CPU kernels, loaded or why not
    cpu_paths: dict = field(default_factory=dict)


def build(cfg: EngineConfig) -> Parts:
    dtype, why = resolve_dtype(cfg.dtype, cfg.backend)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    kernels = kernels_status() if cfg.backend == "cpu" else None
    if kernels is not None and kernels.kind == "other_torch":  # a wheel beside another torch
        raise StartupError(f"{kernels.why} (TRND_CPU_KERNELS=0 runs the torch ops instead)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    mc = ModelConfig.from_dir(cfg.model, cfg.dtype)
    tokenizer = Tokenizer.from_dir(cfg.model)
    if mc.mla is not None and (why := mla_conflict(cfg)):
        raise StartupError(f"{why}: {mc.arch}'s latent KV pool (MLA) runs on the eager path only for now")
    tp = TPGroup(0, cfg.tp, cfg.ep)
    nk = tp.kv_heads(mc.pool.heads)
    tp.split(mc.num_heads, "num_attention_heads")  # refuse a bad layout before starting processes
    check_split(mc, tp, cfg.model)
    page_bytes = kv_page_bytes(mc, nk[1] - nk[0], cfg.page_size, cfg.kv_cache_dtype)
    num_pages = cfg.num_pages or max(2, int(cfg.kv_memory_gb * 2**30) // page_bytes)
    # One pool per rank, on the backend's device; with TP they live in shared memory so this process
    # can reach them all (the ranks all-reduce over gloo, on the CPU).
    device = get_backend(cfg.backend).device if cfg.tp == 1 else "cpu"
    pools = [alloc_kv(mc, nk[1] - nk[0], num_pages, cfg.page_size, shared=cfg.tp > 1, device=device,
                      kv_cache_dtype=cfg.kv_cache_dtype) for _ in range(cfg.tp)]
    workers = None
    if cfg.tp > 1:
        from trnd.engine.workers import WorkerGroup

        workers = WorkerGroup(cfg.tp, cfg.model, cfg.dtype, cfg.backend, pools, cfg.threads, cfg.ep)
        tp = workers.tp
    # inductor packs its own weights: the static path and compiled decode load them plain
    model, mc = load_model(cfg.model, cfg.dtype, tp, cfg.backend,
                           prepack=cfg.backend == "cpu" and not cfg.static and not cfg.compile_decode)
    pool = PagePool(num_pages)
    # The static path's padding writes its KV into this page: reserved for good, never handed out.
    scratch_page = pool.alloc(1)[0] if cfg.static else None
    namespace = page_namespace(cfg, mc)
    radix = RadixCache(pool, cfg.page_size, namespace=namespace)
    scheduler = Scheduler(SchedulerConfig(cfg.page_size, cfg.max_batch, cfg.token_budget, cfg.chunk_size,
                                          cfg.prefix_cache), pool, radix)
    max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, num_pages * cfg.page_size)
    runner = make_runner(cfg, model, mc, pools[0], pool, scratch_page, max_model_len)
    heads = [TPGroup(r, tp.size).kv_heads(mc.pool.heads) for r in range(tp.size)]
    parts = Parts(cfg=cfg, model_config=mc, tokenizer=tokenizer, model=model, tp=tp, pools=pools, workers=workers,
                  pool=pool, radix=radix, scheduler=scheduler, runner=runner, max_model_len=max_model_len,
                  namespace=namespace, scratch_page=scratch_page, kernels=kernels,
                  layout=pool_layout(mc, cfg.page_size, pools[0].dtype, heads),
                  # Per-peer transfer metrics of this process (transfer/metrics.py): the store client's reads and
                  # writes, the roles' KV handoffs; /metrics renders them with the rest (api/metrics.py).
                  xfer_metrics=TransferMetrics(Path(cfg.model).resolve().name),  # the served name: api/metrics.py
                  core_lock=CoreLock(cfg.core_lock) if cfg.core_lock else None)
    if cfg.store or cfg.role in NIXL_ROLES:
        from trnd.transfer.nixl import KVAgent

        parts.agent = KVAgent(f"{cfg.role}-{uuid.uuid4().hex[:8]}", pools, cfg.transfer_backend)
    parts.tiers = make_tiers(parts)
    scheduler.tiers = parts.tiers
    if workers:
        workers.ready()
    loaded = str(mc.dtype).removeprefix("torch.")
    if cfg.backend == "cpu":
        parts.cpu_paths = cpu_paths(loaded, why)
        log.info(describe(loaded, why))
    if cfg.kv_cache_dtype != "auto":  # the compiled CPU kernels take model-dtype pools only (kernels/cpu)
        log.info("kv cache %s: %d-byte pages (values + per-block scales); attention dequantizes on the fly "
                 "in the torch ops", cfg.kv_cache_dtype, runner.page_bytes)
    if cfg.static:
        log.info(runner.summary())
    return parts


def mla_conflict(cfg: EngineConfig) -> str | None:
    """What an MLA model's engine cannot take yet, named by its setting: the static path and compiled decode (their
    traced attention is the GQA one)."""
    if cfg.static:
        return "static = true (or a compile cache) is not served for MLA"
    if cfg.compile_decode:
        return "compile_decode = true is not served for MLA"
    return None


def page_namespace(cfg: EngineConfig, mc: ModelConfig) -> str:
    """Page-hash key space: the same model (config + tokenizer + weights: model/config.py weights_identity)
    and KV dtype on any node, any role (fp8 pages get their own: L2/L3 never hand an fp8 page to a
    model-dtype pool or back). Every L3 key carries it (the chain's root: cache/hashing.py)."""
    model = Path(cfg.model)
    ns = f"{fingerprint(model)}-{weights_identity(model)}:{str(mc.dtype).removeprefix('torch.')}"
    return ns if cfg.kv_cache_dtype == "auto" else f"{ns}:kv={cfg.kv_cache_dtype}"


def make_runner(cfg: EngineConfig, model, mc: ModelConfig, kv: torch.Tensor, pool: PagePool,
                scratch_page: int | None, max_model_len: int) -> ModelRunner:
    """Eager, static (every step padded to a point's buckets), or eager with compiled decode steps."""
    if cfg.static:
        from trnd.engine.static import StaticRunner, resolve_point

        point = resolve_point(cfg.point, page_size=cfg.page_size, max_batch=cfg.max_batch,
                              chunk_size=cfg.chunk_size, max_context=max_model_len)
        return StaticRunner(model, mc, kv, point, scratch_page, compiler=cfg.compiler)
    runner = ModelRunner(model, mc, kv)
    if cfg.compile_decode:
        from trnd.engine.compiled import CompiledDecode

        runner.compiled = CompiledDecode(model)
        page = pool.alloc(1)  # the warm-up's steps write their KV here only
        try:
            log.info("compile_decode: decode graphs compiled in %.1f s", runner.compiled.warmup(runner, page[0]))
        finally:
            pool.unref(page)
    return runner


def make_tiers(p: Parts) -> Tiers | None:
    """L2 (host DRAM, reserved from the node's budget) and L3 (the stores' client, or Mooncake Store) below the
    radix cache."""
    cfg = p.cfg
    mooncake = cfg.remote is not None and cfg.remote.backend == "mooncake"
    if not cfg.prefix_cache or (cfg.host_cache_gb <= 0 and not cfg.store and not mooncake):
        return None
    host = None
    if cfg.host_cache_gb > 0:
        row = sum(kv[0].numel() * kv.element_size() for kv in p.pools)
        slots = int(cfg.host_cache_gb * 2**30) // row
        if cfg.node_host_memory_gb is not None:
            p.budget = NodeBudget(int(cfg.node_host_memory_gb * 2**30))
            p.budget.reserve(slots * row, "host KV tier (host_cache_gb)")
        host = HostTier(p.pools, slots)
    remote = None
    if mooncake:
        from trnd.store.mooncake import MooncakeTier

        try:
            remote = MooncakeTier(cfg.remote, p.layout, p.pools, p.namespace, dtype=p.runner.kv_dtype,
                                  deadline_s=cfg.store_deadline_s, metrics=p.xfer_metrics)
        except RuntimeError as e:  # the extra missing, or no master: one line at start
            raise StartupError(str(e)) from None
    elif cfg.store:
        from trnd.store.client import StoreClient

        if not cfg.store_secret:
            raise ValueError("store: a remote KV store needs the control-plane secret (secret_file)")
        remote = StoreClient(cfg.store, cfg.store_secret, p.agent, p.layout, p.pools, p.namespace,
                             dtype=p.runner.kv_dtype, deadline_s=cfg.store_deadline_s, metrics=p.xfer_metrics)
    return Tiers(p.radix, p.pool, cfg.page_size, p.namespace, host, cfg.host_policy, remote, cfg.store_on_finish)
