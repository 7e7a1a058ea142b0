"""Engine: schedule -> run -> postprocess, one step at a time. Single-threaded by design: the servers
drive it from one loop thread, the offline LLM calls step() directly, so both run the same code."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trnd_kernels import fp8
from trnd.cache.budget import NodeBudget
from trnd.config import SpeculativeConfig, StartupError, compile_decode_conflict
from trnd.cache.host import HostTier
from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache
from trnd.cache.tiers import Tiers
from trnd.engine.corelock import CoreLock
from trnd.engine.output import OutputStream, StepOutput
from trnd.engine.request import Req, SamplingParams
from trnd.backends import get_backend, resolve_dtype
from trnd.backends.cpu import cpu_paths, describe, kernels_status
from trnd.engine.runner import ModelRunner, alloc_kv, kv_page_bytes, prepare
from trnd.engine.sampler import SampleOut, Sampler
from trnd.engine import state, trace
from trnd.engine.parked import Parked
from trnd.engine.scheduler import Batch, Scheduler, SchedulerConfig
from trnd.model.config import ModelConfig, fingerprint, weights_identity
from trnd.model.loader import load_model
from trnd.model.tokenizer import Tokenizer
from trnd.parallel import TPGroup
from trnd.transfer.metrics import TransferMetrics

log = logging.getLogger("trnd.engine")

RECENT = 512  # ended requests whose path /admin/requests/{id} still shows


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
    host_cache_gb: float = 0.0  # L2 host-DRAM tier for evicted prefix pages; 0: off
    host_policy: str = "write-back"  # or write-through
    node_host_memory_gb: float | None = None  # node-wide budget shared with other trnd processes; None: no check
    store: list[str] = field(default_factory=list)  # L3: remote KV stores (host:port); [] = off
    store_secret: bytes | None = None  # control-plane secret the stores share
    store_on_finish: bool = True  # write a finished request's full pages to L3 (the next turn finds them)
    store_deadline_s: float = 1.0  # a store slower than this is a miss
    role: str = "serve"  # names this process's NIXL agent
    static: bool = False  # pad steps to the point's shape buckets, compiled per bucket (engine/static.py)
    point: str | None = None  # decode point whose buckets the static path uses; None: derived from this config
    compiler: str | None = None  # the static path's torch.compile backend; None: static.COMPILERS for the device
    core_lock: str | None = None  # a file the roles sharing this node's cores lock per forward (engine/corelock.py)
    transfer_backend: str = "ucx"  # the NIXL backend of this process's agent (transfer/backends.py)
    remote: object = None  # config.RemoteConfig: the L3 backend (Mooncake: store/mooncake.py); None: `store`
    compile_decode: bool = False  # decode-only steps through one inductor graph (engine/compiled.py); CPU
    speculative: SpeculativeConfig | None = None  # speculative decoding (engine/spec/); None: one token per step

    def __post_init__(self):
        if why := compile_decode_conflict(self.compile_decode, self.backend, self.tp, self.static,
                                          self.kv_cache_dtype):
            raise ValueError(why)
        if self.static and self.tp > 1:
            raise ValueError("static = true runs one rank: tp must be 1")
        if self.static and self.kv_cache_dtype != "auto":
            raise ValueError(f"static = true keeps KV in the model dtype: kv_cache_dtype = {self.kv_cache_dtype!r} "
                             "runs on the eager path (static = false)")


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0  # tokens actually computed for prompts (excludes prefix-cache hits)
    cached_tokens: int = 0
    loaded_tokens: int = 0  # of cached_tokens: loaded from a lower tier instead of recomputed
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    last_step_s: float = 0.0
    last_step_tokens: int = 0
    started: float = field(default_factory=time.time)


class LengthError(ValueError):
    """A prompt, or prompt + max_tokens, that does not fit the context."""


class Engine:
    def __init__(self, cfg: EngineConfig):
        dtype, why = resolve_dtype(cfg.dtype, cfg.backend)
        cfg = self.cfg = dataclasses.replace(cfg, dtype=dtype)
        self.kernels = kernels_status() if cfg.backend == "cpu" else None
        if self.kernels is not None and self.kernels.kind == "other_torch":  # a wheel beside another torch
            raise StartupError(f"{self.kernels.why} (TRND_CPU_KERNELS=0 runs the torch ops instead)")
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        mc = ModelConfig.from_dir(cfg.model, cfg.dtype)
        self.tokenizer = Tokenizer.from_dir(cfg.model)
        tp = TPGroup(0, cfg.tp)
        nk = tp.kv_heads(mc.num_kv_heads)
        tp.split(mc.num_heads, "num_attention_heads")  # refuse a bad layout before starting processes
        page_bytes = kv_page_bytes(mc, nk[1] - nk[0], cfg.page_size, cfg.kv_cache_dtype)
        num_pages = cfg.num_pages or max(2, int(cfg.kv_memory_gb * 2**30) // page_bytes)
        # One pool per rank, on the backend's device; with TP they live in shared memory so this process
        # can reach them all (the ranks all-reduce over gloo, on the CPU).
        device = get_backend(cfg.backend).device if cfg.tp == 1 else "cpu"
        self.pools = [alloc_kv(mc, nk[1] - nk[0], num_pages, cfg.page_size, shared=cfg.tp > 1, device=device,
                               kv_cache_dtype=cfg.kv_cache_dtype) for _ in range(cfg.tp)]
        self.workers = None
        self._agent = None
        if cfg.tp > 1:
            from trnd.engine.workers import WorkerGroup

            self.workers = WorkerGroup(cfg.tp, cfg.model, cfg.dtype, cfg.backend, self.pools, cfg.threads)
            tp = self.workers.tp
        self.model, self.model_config = load_model(cfg.model, cfg.dtype, tp, cfg.backend,
                                                   prepack=cfg.backend == "cpu" and not cfg.static
                                                   and not cfg.compile_decode)  # inductor packs its own
        self.tp = tp
        self.pool = PagePool(num_pages)
        # The static path's padding writes its KV into this page: reserved for good, never handed out.
        self.scratch_page = self.pool.alloc(1)[0] if cfg.static else None
        self.radix = RadixCache(self.pool, cfg.page_size, namespace=self.namespace)
        self.scheduler = Scheduler(SchedulerConfig(cfg.page_size, cfg.max_batch, cfg.token_budget, cfg.chunk_size,
                                                   cfg.prefix_cache), self.pool, self.radix)
        # Roles hook in here: called after each forward, before sampling and finishing (prefill ships
        # the pages a chunk completed while the next chunk computes: roles/prefill.py).
        self.on_forward: Callable[[Batch], None] | None = None
        self.core_lock = CoreLock(cfg.core_lock) if cfg.core_lock else None
        # Pages a role keeps beyond any request: a NIXL write still reading them (prefill), a peer's
        # write that may still land (decode's quarantine). One pool reference each (hold/drop).
        self.held: Counter[int] = Counter()
        self.failures: list[tuple[str, BaseException]] = []  # requests whose KV source gave up (EngineLoop fails them)
        self.integrity = None  # snapshot.Integrity: the last idle-time check (engine/state.py)
        if cfg.static:
            from trnd.engine.static import StaticRunner, resolve_point

            point = resolve_point(cfg.point, page_size=cfg.page_size, max_batch=cfg.max_batch,
                                  chunk_size=cfg.chunk_size, max_context=min(
                                      cfg.max_model_len or mc.max_position_embeddings, num_pages * cfg.page_size))
            self.runner = StaticRunner(self.model, mc, self.pools[0], point, self.scratch_page, compiler=cfg.compiler)
        else:
            self.runner = ModelRunner(self.model, mc, self.pools[0])
        if cfg.compile_decode:
            from trnd.engine.compiled import CompiledDecode

            self.runner.compiled = CompiledDecode(self.model)
            page = self.pool.alloc(1)  # the warm-up's steps write their KV here only
            try:
                log.info("compile_decode: decode graphs compiled in %.1f s",
                         self.runner.compiled.warmup(self.runner, page[0]))
            finally:
                self.pool.unref(page)
        # Per-peer transfer metrics of this process (transfer/metrics.py): the store client's reads and
        # writes, the roles' KV handoffs; /metrics renders them with the rest (api/metrics.py).
        self.xfer_metrics = TransferMetrics(Path(cfg.model).resolve().name)  # the served name: api/metrics.py
        self.tiers = self._make_tiers()
        self.scheduler.tiers = self.tiers
        self.kv_events = None  # trnd/events Recorder once publish_kv_events ran
        if self.workers:
            self.workers.ready()
        self.sampler = Sampler(self.tokenizer.eos_token_ids, seed=cfg.seed, argmax=self.model.ops.argmax)
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, num_pages * cfg.page_size)
        self.spec = None
        if cfg.speculative is not None:
            from trnd.engine.spec.build import speculator

            self.spec = speculator(cfg.speculative, self, num_pages)
        self.streams: dict[str, OutputStream] = {}
        self.stats = EngineStats()
        self.idle_step = False  # the last step had nothing to compute (work parked on transfers)
        self.recent: OrderedDict[str, object] = OrderedDict()  # rid -> snapshot.Trace of the latest ended requests
        loaded = str(self.model_config.dtype).removeprefix("torch.")
        self.cpu_paths = cpu_paths(loaded, why) if cfg.backend == "cpu" else {}
        if cfg.backend == "cpu":
            log.info(describe(loaded, why))
        if cfg.kv_cache_dtype != "auto":  # the compiled CPU kernels take model-dtype pools only (kernels/cpu)
            log.info("kv cache %s: %d-byte pages (values + per-block scales); attention dequantizes on the fly "
                     "in the torch ops", cfg.kv_cache_dtype, self.runner.page_bytes)
        self._grammars = None
        self.compile_cache: str | None = None  # the `trnd compile` dir the role loaded (trnd/compile_cache.py)
        if cfg.static:
            log.info(self.runner.summary())

    @functools.cached_property
    def namespace(self) -> str:
        """Page-hash key space: the same model (config + tokenizer + weights: model/config.py weights_identity)
        and KV dtype on any node, any role (fp8 pages get their own: L2/L3 never hand an fp8 page to a
        model-dtype pool or back). Every L3 key carries it (the chain's root: cache/hashing.py)."""
        model = Path(self.cfg.model)
        ns = f"{fingerprint(model)}-{weights_identity(model)}:{str(self.model_config.dtype).removeprefix('torch.')}"
        return ns if self.cfg.kv_cache_dtype == "auto" else f"{ns}:kv={self.cfg.kv_cache_dtype}"

    def kv_agent(self):
        """This process's one NIXL agent, with every rank's pool registered (made on first use)."""
        if self._agent is None:
            import uuid

            from trnd.transfer.nixl import KVAgent

            self._agent = KVAgent(f"{self.cfg.role}-{uuid.uuid4().hex[:8]}", self.pools, self.cfg.transfer_backend)
        return self._agent

    def layout(self):
        from trnd.transfer.plan import Layout

        mc, n = self.model_config, self.model_config.num_kv_heads
        heads = tuple(TPGroup(r, self.tp.size).kv_heads(n) for r in range(self.tp.size))
        itemsize, scale_bytes = fp8.block_bytes(self.pools[0].dtype, self.cfg.page_size, mc.head_dim)
        return Layout(mc.num_layers, self.cfg.page_size, mc.head_dim, itemsize, heads, scale_bytes)

    def _make_tiers(self) -> Tiers | None:
        cfg = self.cfg
        mooncake = cfg.remote is not None and cfg.remote.backend == "mooncake"
        if not cfg.prefix_cache or (cfg.host_cache_gb <= 0 and not cfg.store and not mooncake):
            return None
        host = None
        if cfg.host_cache_gb > 0:
            row = sum(p[0].numel() * p.element_size() for p in self.pools)
            slots = int(cfg.host_cache_gb * 2**30) // row
            if cfg.node_host_memory_gb is not None:
                self.budget = NodeBudget(int(cfg.node_host_memory_gb * 2**30))
                self.budget.reserve(slots * row, "host KV tier (host_cache_gb)")
            host = HostTier(self.pools, slots)
        remote = None
        if mooncake:
            from trnd.store.mooncake import MooncakeTier

            try:
                remote = MooncakeTier(cfg.remote, self.layout(), self.pools, self.namespace,
                                      dtype=self.runner.kv_dtype, deadline_s=cfg.store_deadline_s,
                                      metrics=self.xfer_metrics)
            except RuntimeError as e:  # the extra missing, or no master: one line at start
                raise StartupError(str(e)) from None
        elif cfg.store:
            from trnd.store.client import StoreClient

            if not cfg.store_secret:
                raise ValueError("store: a remote KV store needs the control-plane secret (secret_file)")
            remote = StoreClient(cfg.store, cfg.store_secret, self.kv_agent(), self.layout(), self.pools,
                                 self.namespace, dtype=self.runner.kv_dtype,
                                 deadline_s=cfg.store_deadline_s, metrics=self.xfer_metrics)
        return Tiers(self.radix, self.pool, cfg.page_size, self.namespace, host, cfg.host_policy, remote,
                     cfg.store_on_finish)

    @property
    def grammars(self):
        """The llguidance side (engine/grammar.py), made on the first request that has a grammar."""
        if self._grammars is None:
            from trnd.engine.grammar import Grammars

            self._grammars = Grammars((Path(self.cfg.model) / "tokenizer.json").read_text(encoding="utf-8"),
                                      self.model_config.vocab_size, self.tokenizer.eos_token_ids)
        return self._grammars

    # -- requests -----------------------------------------------------------------------------------

    def check_length(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt >= self.max_model_len:
            raise LengthError(f"This model's maximum context length is {self.max_model_len} tokens. "
                              f"However, your prompt has {num_prompt} tokens.")
        if num_prompt + max_tokens > self.max_model_len:
            raise LengthError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                              f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.")

    def add(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
            session_id: str | None = None) -> Req:
        self.check_length(len(prompt_ids), params.max_tokens)
        req = Req(prompt_ids, params, rid, session_id)
        if req.rid in self.streams:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if params.grammar is not None:
            req.grammar = self.grammars.state(params.grammar)
        self.streams[req.rid] = OutputStream(self.tokenizer, req)
        self.scheduler.add(req)
        self.stats.prompt_tokens += req.num_prompt
        trace.phase(req, f"queued: {req.num_prompt} prompt tokens, max_tokens={params.max_tokens}")
        return req

    def take_prompt_kv_from(self, start: Callable[[Req], Parked | None]) -> None:
        """Disaggregated decode: a new request's prompt KV comes from `start(req)` (roles/decode.py: a
        prefill peer), parked in the scheduler like a tier load (engine/parked.py); None: computed here."""
        self.scheduler.peer = start

    def hold(self, pages: list[int]) -> None:
        self.pool.ref(pages)
        self.held.update(pages)

    def drop(self, pages: list[int]) -> None:
        self.held.subtract(pages)
        self.held += Counter()  # drop the zeros
        self.pool.unref(pages)

    def abort(self, rid: str) -> StepOutput | None:
        req = self.scheduler.find(rid)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")  # a parked request keeps its pages until its source is done
        self._ended(rid)
        self.stats.aborted += 1
        self.remember(trace.finished(req, "abort"))
        return self.streams.pop(rid).finish(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def load(self) -> int:
        """Requests in the engine (running, parked, queued): what a peer balances on."""
        return self.scheduler.num_active + len(self.scheduler.waiting)

    # -- the step -----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.stats.preemptions += len(batch.preempted)
        arrived = [self._landed(req, got) for req, got in batch.arrived]
        for req, error in batch.failed:
            self.streams.pop(req.rid, None)
            self._ended(req.rid)
            self.failures.append((req.rid, error))
            self.remember(trace.finished(req, "error", error))
        self.idle_step = batch.empty and not arrived and not batch.failed
        if batch.empty:
            if arrived:
                self._propose()
            return arrived
        inputs, sampled = prepare(batch, self.cfg.page_size)
        if self.workers:
            self.workers.step(inputs)
        with self.core_lock.held() if self.core_lock is not None else contextlib.nullcontext():
            logits = self.runner.forward(inputs)
        if self.on_forward:
            self.on_forward(batch)
        outs = self.postprocess(batch, logits, sampled)
        self._propose()
        self.stats.steps += 1
        self.stats.last_step_s = time.perf_counter() - t0
        self.stats.last_step_tokens = batch.num_tokens
        return arrived + outs

    def _propose(self) -> None:
        """Drafts for the next step (engine/spec/): a draft model's forwards run here, under the core lock."""
        if self.spec is None:
            return
        with self.core_lock.held() if self.core_lock is not None else contextlib.nullcontext():
            self.spec.propose([r for r in self.scheduler.running if not r.is_prefilling], len(self.scheduler.running))

    def _landed(self, req: Req, got) -> StepOutput:
        """A peer wrote the prompt's KV and sampled its first token: stream it, decode the rest here."""
        self.stats.prefill_tokens += got.computed_tokens
        return self.deliver(req, got.first)

    def postprocess(self, batch, logits: torch.Tensor, sampled: list[Req]) -> list[StepOutput]:
        for req, n in batch.prefill:
            if req.num_computed == req.num_cached and req.num_output == 0:
                self.stats.cached_tokens += req.num_cached
                self.stats.loaded_tokens += req.num_loaded
                trace.phase(req, f"prefill start: {req.num_prompt - req.num_cached} tokens to compute after "
                                 f"{req.num_cached} cached")
            req.num_computed += n
            self.stats.prefill_tokens += n
        if not any(r.draft_ids for r in batch.decode):
            for req in batch.decode:
                req.num_computed += 1
            samples = self.sampler.sample(logits, sampled) if sampled else []
            return [self.deliver(req, s) for req, s in zip(sampled, samples)]
        # Speculative decoding: a request's drafted rows keep what the target accepts; their KV is valid up to
        # the last kept token, the rest of the drafted slots are reclaimed (Scheduler.trim).
        decoding = {id(r) for r in batch.decode}
        outs = []
        for req, samples in zip(sampled, self.sampler.verify(logits, sampled)):
            if id(req) in decoding:
                if req.draft_ids:
                    self.spec.record(req, len(req.draft_ids), len(samples) - 1)
                    req.draft_ids, req.draft_probs = [], None
                req.num_computed += len(samples)
            outs.append(self.deliver(req, *samples))
            if not req.finished:
                self.scheduler.trim(req)
        return outs

    def deliver(self, req: Req, *samples: SampleOut) -> StepOutput:
        """Append sampled tokens (here, or on a prefill server; several where speculation kept drafts) and
        finish the request once it is done (tokens after that are dropped)."""
        now = time.monotonic()
        stream = self.streams[req.rid]
        for s in samples:
            req.output_ids.append(s.token)
            if req.grammar is not None:
                req.grammar.advance(s.token)
            if s.logprob is not None:
                req.output_logprobs.append((s.logprob, s.top_logprobs or []))
            if req.first_token_time is None:
                req.first_token_time = now
                trace.phase(req, "first token")
            req.last_token_time = now
            self.stats.generation_tokens += 1
            reason = self._finish_reason(req, stream.push(s))
            if reason is not None:
                req.num_computed = min(req.num_computed, req.num_tokens)  # a kept draft past the finish
                self.scheduler.finish(req, reason)
                self.stats.finished += 1
                self.remember(trace.finished(req, reason))
                self.streams.pop(req.rid)
                self._ended(req.rid)
                return stream.finish(req)
        return stream.take(req)

    def _ended(self, rid: str) -> None:
        if self.spec is not None:
            self.spec.release(rid)

    def _finish_reason(self, req: Req, stopped_by_string: bool) -> str | None:
        p, tok = req.params, req.output_ids[-1]
        if stopped_by_string or tok in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and tok in self.sampler.eos_token_ids and req.num_output > p.min_tokens - 1:
            return "stop"
        if req.num_output >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def publish_kv_events(self, cfg, host: str = "127.0.0.1") -> None:
        """KV events in vLLM's format from this engine's prefix cache (trnd/events; cfg: config.KVEventsConfig,
        host: where an endpoint left unset binds). A bind that fails is a StartupError naming the endpoint."""
        if cfg is None or not cfg.on or self.kv_events is not None:
            return
        from trnd.events.hashes import VllmHasher
        from trnd.events.publisher import Publisher
        from trnd.events.record import Recorder

        try:
            hasher = VllmHasher(cfg.hash_algo, cfg.hash_seed)
            pub = Publisher(cfg.endpoint or f"tcp://{host}:0", cfg.replay_endpoint or f"tcp://{host}:0", cfg.topic,
                            cfg.buffer_steps, cfg.hwm, cfg.max_queue_size)
        except (OSError, ValueError) as e:  # a port taken, a bad endpoint, cbor2 missing: one line, exit 78
            raise StartupError(f"kv_events: {e}") from None
        self.kv_events = Recorder(self.cfg.page_size, hasher, pub.publish)
        self.kv_events.publisher = pub
        self.radix.events = self.kv_events

    def poll(self) -> bool:
        """Housekeeping between steps (every loop iteration, idle or not): reap finished tier transfers,
        publish the KV events the step made. True while any transfer is in flight."""
        if self.kv_events is not None:
            self.kv_events.flush()
        if self.tiers is None:
            return False
        self.tiers.poll()
        return self.tiers.busy

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()
            self.kv_events.publisher.close()
            self.kv_events = None
        if self.core_lock is not None:
            self.core_lock.close()
            self.core_lock = None
        if self.tiers is not None:
            self.tiers.close()
        if self.workers:
            self.workers.close()
            self.workers = None

    # -- inspection (engine/state.py) -------------------------------------------------------------------

    def remember(self, t) -> None:
        """Keep an ended request's Trace (the latest RECENT of them) for /admin/requests/{id}."""
        self.recent[t.id] = t
        self.recent.move_to_end(t.id)
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)

    def traces(self, rid: str) -> list:
        return state.request_traces(self, rid)

    def check_integrity(self) -> dict:
        return state.check_integrity(self)

    def check_when_idle(self) -> None:
        state.check_when_idle(self)

    def state(self):
        """The /admin/state engine snapshot (a trnd/snapshot.py State)."""
        return state.engine_state(self)
