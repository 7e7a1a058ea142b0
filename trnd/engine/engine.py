"""Engine: schedule -> run -> postprocess, one step at a time. Single-threaded by design: the servers
drive it from one loop thread, the offline LLM calls step() directly, so both run the same code."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trnd.config import StartupError
from trnd.engine import state, trace
from trnd.engine.build import Parts
from trnd.engine.output import OutputStream, StepOutput
from trnd.engine.parked import Parked
from trnd.engine.request import Req, SamplingParams
from trnd.engine.runner import prepare
from trnd.engine.sampler import SampleOut, Sampler
from trnd.engine.scheduler import Batch

log = logging.getLogger("trnd.engine")

RECENT = 512  # ended requests whose path /admin/requests/{id} still shows


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
    """The requests over an assembled engine (engine/build.py): add, abort, step, deliver."""

    def __init__(self, parts: Parts):
        cfg = self.cfg = parts.cfg
        self.model, self.model_config, self.tokenizer = parts.model, parts.model_config, parts.tokenizer
        self.tp, self.pools, self.workers = parts.tp, parts.pools, parts.workers
        self.pool, self.scratch_page = parts.pool, parts.scratch_page
        self.radix, self.scheduler, self.runner, self.tiers = parts.radix, parts.scheduler, parts.runner, parts.tiers
        self.max_model_len, self.namespace, self.layout = parts.max_model_len, parts.namespace, parts.layout
        self.agent, self.xfer_metrics, self.budget = parts.agent, parts.xfer_metrics, parts.budget
        self.core_lock, self.kernels, self.cpu_paths = parts.core_lock, parts.kernels, parts.cpu_paths
        # Roles hook in here: called after each forward, before sampling and finishing (prefill ships
        # the pages a chunk completed while the next chunk computes: roles/prefill.py).
        self.on_forward: Callable[[Batch], None] | None = None
        # Pages a role keeps beyond any request: a NIXL write still reading them (prefill), a peer's
        # write that may still land (decode's quarantine). One pool reference each (hold/drop).
        self.held: Counter[int] = Counter()
        self.failures: list[tuple[str, BaseException]] = []  # requests whose KV source gave up (EngineLoop fails them)
        self.integrity = None  # snapshot.Integrity: the last idle-time check (engine/state.py)
        self.kv_events = None  # trnd/events Recorder once publish_kv_events ran
        self.sampler = Sampler(self.tokenizer.eos_token_ids, seed=cfg.seed, argmax=self.model.ops.argmax)
        self.spec = None  # speculative decoding (engine/spec/): drafts proposed after each step, verified in the next
        if cfg.speculative is not None:
            from trnd.engine.spec.build import speculator

            self.spec = speculator(cfg.speculative, self, self.pool.num_pages)
        self.streams: dict[str, OutputStream] = {}
        self.stats = EngineStats()
        self.idle_step = False  # the last step had nothing to compute (work parked on transfers)
        self.recent: OrderedDict[str, object] = OrderedDict()  # rid -> snapshot.Trace of the latest ended requests
        self._grammars = None
        self.compile_cache: str | None = None  # the `trnd compile` dir the role loaded (trnd/compile_cache.py)

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
        trace.phase(req, f"queued: {req.num_prompt} prompt tokens, max_tokens={params.max_tokens}"
                         + (f", priority={req.priority}" if req.priority else ""))
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
            t_forward = time.perf_counter()  # the lock's wait is not the step's cost
            logits = self.runner.forward(inputs)
            t_forward = time.perf_counter() - t_forward
        if self.on_forward:
            self.on_forward(batch)
        t_post, generated = time.perf_counter(), self.stats.generation_tokens
        outs = self.postprocess(batch, logits, sampled)
        if self.spec is not None and not batch.prefill and not arrived:  # decode-only: what speculation weighs
            self.spec.measured(len(batch.decode), self.stats.generation_tokens - generated,
                               t_forward + time.perf_counter() - t_post)
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
