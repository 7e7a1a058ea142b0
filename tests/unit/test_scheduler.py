"""The scheduler as plain Python: admission by free pages, chunked prefill under a token budget,
preemption when pages run out, abort freeing pages. No model, no torch."""

from __future__ import annotations

from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache, check_pool_integrity
from trnd.engine.request import Req, SamplingParams, Status
from trnd.engine.scheduler import Scheduler, SchedulerConfig


def make(num_pages=32, **kw):
    cfg = SchedulerConfig(**{"page_size": 4, "max_batch": 8, "token_budget": 16, "chunk_size": 16, **kw})
    pool = PagePool(num_pages)
    radix = RadixCache(pool, cfg.page_size)
    return Scheduler(cfg, pool, radix), pool, radix


def run_step(s: Scheduler, next_token=1):
    """What the engine does after a forward: advance counters, append a token where one is sampled."""
    b = s.schedule()
    for r in b.decode:
        r.num_computed += 1
        r.output_ids.append(next_token)
    for r, n in b.prefill:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(next_token)
    return b


def integrity(s, pool, radix):
    radix.check_integrity()
    return check_pool_integrity(pool, radix, [r.pages for r in s.running])


def req(n, max_tokens=4, start=0):
    return Req(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def test_chunked_prefill_respects_budget_and_chunk():
    s, pool, radix = make(token_budget=10, chunk_size=6)
    a, b = req(14), req(5, start=100)
    s.add(a)
    s.add(b)
    b1 = run_step(s)
    assert [(r.rid, n) for r, n in b1.prefill] == [(a.rid, 6), (b.rid, 4)]
    assert b1.num_tokens <= 10
    b2 = run_step(s)
    assert [(r.rid, n) for r, n in b2.prefill] == [(a.rid, 6), (b.rid, 1)]
    assert b.num_output == 1  # b's prompt finished: sampled
    b3 = run_step(s)
    assert [r.rid for r in b3.decode] == [b.rid] and [(r.rid, n) for r, n in b3.prefill] == [(a.rid, 2)]
    assert len(a.pages) == 4  # 14 tokens / page 4
    integrity(s, pool, radix)


def test_admission_waits_for_pages_then_proceeds():
    s, pool, radix = make(num_pages=4, token_budget=24, chunk_size=24)
    a, b = req(12), req(12, start=50)
    s.add(a)
    s.add(b)
    b1 = run_step(s)
    assert [r for r, _ in b1.prefill] == [a]  # b needs 3 pages, only 1 left
    assert list(s.waiting) == [b]
    s.finish(a, "stop")
    b2 = run_step(s)
    assert [r for r, _ in b2.prefill] == [b]
    assert integrity(s, pool, radix)["in_use"] == 3


def test_decode_growth_preempts_youngest_and_it_recovers():
    s, pool, radix = make(num_pages=6, prefix_cache=False)
    a, b = req(8, max_tokens=20), req(8, max_tokens=20, start=30)
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(12):
        preempted += run_step(s).preempted
        integrity(s, pool, radix)
    assert b in preempted and a not in preempted
    assert b.num_preemptions >= 1
    assert b.status in (Status.WAITING, Status.RUNNING)
    assert a.num_output > b.num_output


def test_abort_at_any_time_frees_pages():
    s, pool, radix = make(prefix_cache=False)
    reqs = [req(9, start=10 * i) for i in range(5)]
    for r in reqs:
        s.add(r)
    run_step(s)
    run_step(s)
    for r in reqs:  # running ones, and waiting ones
        s.finish(r, "abort")
    assert not s.has_work
    assert pool.num_free == pool.num_pages
    assert integrity(s, pool, radix)["in_use"] == 0


def test_prefix_hit_borrows_pages_and_skips_compute():
    s, pool, radix = make()
    a = req(13)
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    assert radix.num_cached_pages == 3
    b = req(13)  # same prompt: 12 tokens (3 pages) cached, the last token recomputed
    s.add(b)
    b1 = run_step(s)
    assert b.num_cached == 12 and b1.prefill == [(b, 1)]
    assert integrity(s, pool, radix)["in_use"] == 4
    s.finish(b, "stop")
    assert integrity(s, pool, radix)["in_use"] == 0


def test_max_batch_limits_running():
    s, pool, radix = make(max_batch=2, token_budget=100)
    for i in range(4):
        s.add(req(3, start=10 * i))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2
