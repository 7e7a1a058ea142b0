"""A request at 1,048,576 tokens of context on the `1m` point: every page accounted for (none leaked) after
the prefill, the decode, the eviction to L2 and the reload from it. One decoder layer (bench/million.py says
why), fp32."""

from __future__ import annotations

import random

import pytest

from trnd.bench.million import million_model
from trnd.engine.build import EngineConfig, build
from trnd.engine.engine import Engine
from trnd.engine.request import SamplingParams
from trnd.points import get_point


@pytest.mark.slow
def test_a_million_token_request_leaks_no_page():
    point = get_point("1m")
    n = point.max_context
    e = Engine(build(EngineConfig(model=str(million_model(n)), dtype="float32", page_size=point.page_size,
                                  num_pages=point.pool_pages_needed() + 8, max_model_len=n, max_batch=point.max_batch,
                                  token_budget=point.prefill_chunk, chunk_size=point.prefill_chunk,
                                  host_cache_gb=0.3)))
    try:
        rng = random.Random(0)
        prompt = [rng.randrange(10, 1000) for _ in range(n - 2)]
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        first = e.add(prompt, greedy, rid="first")
        while e.has_work:
            e.step()
        assert first.finished and first.num_output == 2 and first.num_computed == 0  # released
        full = (n - 1) // point.page_size  # the pages of whole pages of the prompt + first output token
        assert e.radix.num_cached_pages == full
        check = e.check_integrity()
        assert e.pool.num_free + e.radix.num_cached_pages == e.pool.num_pages, check
        assert e.radix.reset() == full and e.pool.num_free == e.pool.num_pages  # all to L2
        again = e.add(prompt, greedy, rid="again")
        while e.has_work:
            e.step()
        assert again.loaded_from.get("host") == (n - 3) // point.page_size * point.page_size
        assert again.output_ids == first.output_ids
        e.check_integrity()
        assert e.pool.num_free + e.radix.num_cached_pages == e.pool.num_pages
        assert not e.scheduler.running and not e.scheduler.waiting and not e.scheduler.parked and not e.held
    finally:
        e.close()
