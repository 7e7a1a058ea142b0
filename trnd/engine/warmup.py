"""Warm-up before READY: the first forward pays for allocator growth, kernel selection and (on
accelerators) compilation, which READY must not leave to the first client."""

from __future__ import annotations

import contextlib
import time

from trnd.sampling_params import SamplingParams


def warm_up(engine, max_tokens: int = 2) -> float:
    """One tiny greedy generation on the engine before its loop thread starts: the first forward pays
    for allocator growth, kernel selection and (on accelerators) compilation, which READY must not
    leave to the first client. The prompt is shorter than a page, so nothing lands in the prefix
    cache; the counters are reset so /metrics starts from zero. Returns the seconds it took."""
    t0 = time.perf_counter()
    ids = engine.tokenizer.encode("warm up", add_special_tokens=True)[:4] or [0]
    engine.add(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), rid="trnd-warmup")
    while engine.has_work:
        engine.step()
    # Then one full prefill chunk: the first chunk of a new size pays for the allocator and the kernels'
    # workspaces once (measured: a first 2048-token prefill 1.2 s, the next ones 0.56 s); its pages are
    # dropped from the prefix cache again.
    n = min(engine.cfg.chunk_size, engine.max_model_len - 2)
    if n > len(ids):
        vocab = engine.model_config.vocab_size
        tiers, engine.scheduler.tiers = engine.scheduler.tiers, None  # nothing of it goes to L2 or a store
        try:
            engine.add([3 + i % (vocab - 3) for i in range(n)],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), rid="trnd-warmup-chunk")
            while engine.has_work:
                engine.step()
        finally:
            engine.scheduler.tiers = tiers
        engine.radix.reset()
        if tiers is not None:
            tiers.reset()  # what the reset just wrote back to L2
    engine.stats = type(engine.stats)()
    return time.perf_counter() - t0


async def warm_up_loop(loop, max_tokens: int = 2) -> None:
    """The same through a running EngineLoop (decode: the first token comes from a prefill peer, so
    this also proves the handoff path end to end)."""
    ids = loop.engine.tokenizer.encode("warm up", add_special_tokens=True)[:4] or [0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with contextlib.aclosing(loop.generate(ids, params, "trnd-warmup")) as outs:
        async for _ in outs:
            pass
