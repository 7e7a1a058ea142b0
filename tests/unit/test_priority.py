"""Priorities in the scheduler (vLLM's `priority`, lower first): admitted ahead of queued low ones,
preempting a worse running request when the batch is full, and bounded: a low priority still finishes.
Plain Python, no model."""

from __future__ import annotations

from trnd.cache.pages import PagePool
from trnd.cache.radix import RadixCache, check_pool_integrity
from trnd.engine.request import Req, SamplingParams
from trnd.engine.scheduler import Scheduler, SchedulerConfig


def make(num_pages=64, **kw):
    cfg = SchedulerConfig(**{"page_size": 4, "max_batch": 2, "token_budget": 64, "chunk_size": 16, **kw})
    pool = PagePool(num_pages)
    radix = RadixCache(pool, cfg.page_size)
    return Scheduler(cfg, pool, radix), pool, radix


def req(n, priority=0, max_tokens=3, start=0):
    return Req(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, priority=priority))


def run_step(s: Scheduler):
    """The engine's postprocess: counters forward, a token where one is sampled, finish at max_tokens."""
    b = s.schedule()
    for r in b.decode:
        r.num_computed += 1
        r.output_ids.append(1)
    for r, n in b.prefill:
        r.num_computed += n
        if r.num_computed == r.num_tokens:
            r.output_ids.append(1)
    for r in [*b.decode, *(r for r, _ in b.prefill)]:
        if r.num_output >= r.params.max_tokens:
            s.finish(r, "length")
    return b


def admitted(b):
    return [r.rid for r, _ in b.prefill]


def test_high_priority_is_admitted_ahead_of_queued_low_ones_and_the_low_ones_finish():
    s, pool, radix = make(max_batch=1)
    lows = [req(8, priority=5, start=100 * i) for i in range(3)]
    for r in lows:
        s.add(r)
    b = run_step(s)
    assert admitted(b) == [lows[0].rid]
    high = req(8, priority=-1, start=900)
    s.add(high)
    order = []
    while s.has_work:
        b = run_step(s)
        order += [rid for rid in admitted(b) if rid not in order]
    # the running low one was preempted for the high one (batch full), then resumed first among the lows
    assert order[0] == high.rid
    assert all(r.finished and r.num_output == 3 for r in [*lows, high])
    assert lows[0].num_preemptions == 1
    check_pool_integrity(pool, radix, [])


def test_equal_priorities_keep_fcfs():
    s, _, _ = make(max_batch=1)
    rs = [req(4, start=10 * i) for i in range(4)]
    for r in rs:
        s.add(r)
    order = []
    while s.has_work:
        b = run_step(s)
        order += admitted(b)
    assert order == [r.rid for r in rs]
    assert all(r.num_preemptions == 0 for r in rs)


def test_a_low_priority_is_passed_at_most_max_overtakes_times():
    """A stream of high-priority requests that never lets up: the low one still runs after K of them."""
    k = 3
    s, pool, radix = make(max_batch=1, max_overtakes=k)
    low = req(4, priority=10, start=500)
    s.add(low)
    highs, started_low_after = [], None
    for i in range(12):
        h = req(4, priority=0, start=10 * i)
        highs.append(h)
        s.add(h)  # always one high waiting next to the low one
        while not h.finished and not low.finished:
            b = run_step(s)
            if low.rid in admitted(b) and started_low_after is None:
                started_low_after = sum(x.num_output > 0 for x in highs if x is not h)
        if low.finished:
            break
    while s.has_work:
        run_step(s)
    assert low.finished and low.num_output == 3
    assert started_low_after is not None and started_low_after <= k
    check_pool_integrity(pool, radix, [])


def test_page_pressure_preempts_the_lowest_priority_not_the_youngest():
    # pages for two 16-token prompts plus a little growth: decoding pushes one out
    s, pool, radix = make(num_pages=9, max_batch=4, prefix_cache=False)
    vip = req(16, priority=-5, max_tokens=8, start=0)
    low = req(16, priority=5, max_tokens=8, start=100)
    s.add(low)
    s.add(vip)  # younger, but better ranked
    victims = []
    while s.has_work:
        b = run_step(s)
        victims += [r.rid for r in b.preempted]
    assert victims and set(victims) == {low.rid}
    assert vip.num_preemptions == 0 and vip.finished and low.finished and low.num_output == 8
    check_pool_integrity(pool, radix, [])


def test_the_api_field_reaches_the_engine_request():
    import msgspec

    from trnd.api import protocol as P
    from trnd.api.errors import APIError
    from trnd.api.params import to_sampling_params

    body = msgspec.json.decode(b'{"prompt": "hi", "priority": -3}', type=P.CompletionRequest)
    params, _ = to_sampling_params(body, max_n=4)
    assert params.priority == -3 and Req([1], params).priority == -3
    assert to_sampling_params(msgspec.json.decode(b'{"prompt": "hi"}', type=P.CompletionRequest), 4)[0].priority == 0
    try:
        to_sampling_params(msgspec.json.decode(b'{"prompt": "hi", "priority": 9223372036854775808}',
                                               type=P.CompletionRequest), 4)
    except APIError as e:
        assert e.param == "priority"
    else:
        raise AssertionError("a priority beyond int64 was accepted")


def test_req_ids_is_a_slice_of_all_ids():
    r = Req([1, 2, 3, 4], SamplingParams())
    r.output_ids += [5, 6]
    for a in range(7):
        for b in range(a, 8):
            assert r.ids(a, b) == r.all_ids[a:b]
