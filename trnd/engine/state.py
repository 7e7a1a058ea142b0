"""What the engine shows of itself: the page owners, the pool integrity check (run by the loop
whenever it goes idle, so a leak shows up in /admin/state and `trnd top`, not just in tests) and the
/admin/state engine snapshot."""

from __future__ import annotations

import dataclasses
import logging
import time

from trnd import snapshot as S
from trnd.cache.radix import check_pool_integrity
from trnd.engine import trace
from trnd.engine.request import Req, Status
from trnd.model.moe import expert_bytes

log = logging.getLogger("trnd.engine")


def owner_lists(engine) -> list[list[int]]:
    """Every list of pages something holds one pool reference on per entry: requests (running or
    parked), parked jobs, tier transfers, the role's held pages, the static path's scratch page."""
    owners = engine.scheduler.owner_lists()
    if engine.tiers is not None:
        owners += engine.tiers.held_pages()
    if engine.scratch_page is not None:
        owners.append([engine.scratch_page])
    owners += [[p] * n for p, n in engine.held.items()]
    return owners


def check_integrity(engine) -> dict:
    """Tree invariants, then exact refcounts: free + cached-only + in-use == total. Raises AssertionError."""
    engine.radix.check_integrity(strict=False)
    if engine.spec is not None:
        engine.spec.check_integrity(set(engine.streams))
    return check_pool_integrity(engine.pool, engine.radix, owner_lists(engine))


def check_when_idle(engine) -> None:
    """The loop thread calls this when it runs out of work; the outcome is kept for /admin/state."""
    t0 = time.perf_counter()
    try:
        counts, error = check_integrity(engine), None
    except AssertionError as e:
        counts, error = None, str(e) or "assertion failed"
        log.error("page pool integrity check failed: %s", error)
    prev = engine.integrity or S.Integrity()
    engine.integrity = S.Integrity(ok=error is None, error=error, checks=prev.checks + 1,
                                   failures=prev.failures + (error is not None), at=time.time(),
                                   ms=round((time.perf_counter() - t0) * 1e3, 3),
                                   pages=S.part(S.Pages, counts))


def _phase(engine, r: Req) -> str:
    job = engine.scheduler.parked.get(r.rid)
    if job is not None:
        return job.phase  # loading_kv: an L2 copy or an L3 read; waiting_for_kv: a prefill peer
    if r.status is Status.WAITING:
        return "waiting"
    return "prefilling" if r.is_prefilling else "decoding"


def engine_state(engine) -> S.State:
    """The engine's part of /admin/state (the role adds its own: api/app.py)."""
    now = time.monotonic()
    sched = engine.scheduler

    def req_state(r: Req) -> S.Request:
        dt = (r.last_token_time or now) - (r.first_token_time or now)
        return S.Request(id=r.rid, session_id=r.session_id, state=_phase(engine, r), prompt_tokens=r.num_prompt,
                         cached_tokens=r.num_cached, computed_tokens=r.num_computed, generated_tokens=r.num_output,
                         max_tokens=r.params.max_tokens, pages=len(r.pages),
                         tokens_per_s=round((r.num_output - 1) / dt, 2) if dt > 0 and r.num_output > 1 else None,
                         age_s=round(now - r.arrival, 3), preemptions=r.num_preemptions)

    live = [j for j in sched.parked.values() if not j.aborted]
    held = {p for pages in owner_lists(engine) for p in pages}
    cached_only = engine.radix.num_cached_pages - len(held & set(engine.radix.all_pages()))
    ranks = engine.workers.health() if engine.workers else [{"rank": 0, "alive": True}]
    return S.State(
        running=[req_state(r) for r in (*sched.running, *(j.req for j in live if j.phase == "waiting_for_kv"))],
        waiting=[req_state(r) for r in (*sched.waiting, *(j.req for j in live if j.phase != "waiting_for_kv"))],
        pages=S.Pages(total=engine.pool.num_pages, free=engine.pool.num_free, in_use=len(held), cached=cached_only,
                      page_size=engine.cfg.page_size, page_bytes=engine.runner.page_bytes,
                      kv_dtype=engine.runner.kv_dtype, token_capacity=engine.pool.num_pages * engine.cfg.page_size,
                      kind=engine.layout.kind),
        radix=S.part(S.Radix, engine.radix.stats()),
        tiers=S.part(S.Tiers, engine.tiers.stats() if engine.tiers is not None else None),
        stats=S.Stats(**dataclasses.asdict(engine.stats),
                      core_lock_wait_s=engine.core_lock.waited_s if engine.core_lock is not None else 0.0),
        layout=S.Layout(tp=engine.tp.size, ep=engine.tp.ep, expert_bytes=expert_bytes(engine.model),
                        kv_heads_per_rank=engine.runner.num_kv_heads,
                        ranks=[S.Rank(**r) for r in ranks]),
        limits=S.Limits(max_model_len=engine.max_model_len, max_batch=engine.cfg.max_batch,
                        token_budget=engine.cfg.token_budget, chunk_size=engine.cfg.chunk_size),
        static=static_state(engine),
        integrity=engine.integrity,
        kernels=kernels_state(engine.kernels),
        kv_events=kv_events_state(engine.kv_events),
        spec=engine.spec.state() if engine.spec is not None else None,
    )


def kv_events_state(rec) -> S.KVEvents | None:
    if rec is None:
        return None
    return S.KVEvents(**rec.publisher.state(), block_size=rec.page_size, hash_algo=rec.hasher.algo,
                      stored_blocks=rec.stored_blocks, removed_blocks=rec.removed_blocks)


def kernels_state(k) -> S.Kernels | None:
    if k is None:
        return None
    return S.Kernels(loaded=k.loaded, build=k.build, kind=k.kind, why=k.why, slow_path=k.slow_path)


def request_traces(engine, rid: str) -> list[S.Trace]:
    """/admin/requests/{rid}: the request with this id (or, on prefill, `p<peer>/<rid>`) live in the
    scheduler or among the recently ended, with its phases so far (engine/trace.py)."""
    def match(r: str) -> bool:
        base, dash, i = r.rpartition("-")
        for name in (r, base) if dash and i.isdigit() else (r,):  # an n > 1 request's choice i is `<id>-<i>`
            if name == rid or name.endswith("/" + rid):
                return True
        return False

    sched = engine.scheduler
    live = [*sched.running, *sched.waiting, *(j.req for j in sched.parked.values() if not j.aborted)]
    out = [trace.record(r, _phase(engine, r)) for r in live if match(r.rid)]
    seen = {t.id for t in out}
    return out + [t for r, t in engine.recent.items() if match(r) and r not in seen]


def static_state(engine) -> S.Static | None:
    runner = engine.runner
    if not engine.cfg.static:
        return None
    loaded, compiled = runner.counts()
    return S.Static(point=runner.point.name or None, compiler=str(runner.compiler),
                    decode_buckets=runner.decode_buckets, prefill_buckets=runner.prefill_buckets,
                    widths=runner.widths, graphs=len(runner.buckets()), used=len(runner.used), loaded=loaded,
                    compiled=compiled, compile_cache=engine.compile_cache)
