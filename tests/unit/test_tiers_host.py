"""L2 host tier: pages evicted from a small device pool come back from host DRAM on a later hit,
token-identical to a big pool, with fewer prompt tokens computed. And the node-wide host budget."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from trnd.cache.budget import BudgetExceeded, NodeBudget
from trnd.engine.request import SamplingParams
from trnd.llm import LLM

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def workload():
    """Four 'sessions' with 160-token histories, revisited after the others: an agentic replay."""
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(5, 1000, (160,), generator=g).tolist() for _ in range(4)]
    turns = [[h + [7, 7, 7]] for h in hist] + [[h + [9, 9]] for h in hist]
    return [t[0] for t in turns]


def run(model, prompts, **kw):
    llm = LLM(str(model), page_size=8, max_batch=1, **kw)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]  # one at a time: a replay
    llm.engine.check_integrity()
    return outs, llm.engine


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_evicted_pages_come_back_from_host(tiny_qwen3, policy):
    prompts = workload()
    big, _ = run(tiny_qwen3, prompts, num_pages=512)
    small, e0 = run(tiny_qwen3, prompts, num_pages=24)  # holds one history (21 pages), not four
    tiered, e1 = run(tiny_qwen3, prompts, num_pages=24, host_cache_gb=0.01, host_policy=policy)
    assert small == big and tiered == big
    assert e1.stats.loaded_tokens >= 4 * 160 - 4 * 8  # each revisit found its history in L2
    assert e1.stats.prefill_tokens < e0.stats.prefill_tokens - 500
    host = e1.state().tiers.host
    assert host.loaded > 0 and host.stored > 0 and host.hits > 0


def test_host_tier_stays_within_its_slots(tiny_qwen3):
    prompts = workload()
    _, e = run(tiny_qwen3, prompts, num_pages=24, host_cache_gb=0.00002)  # a few slots only
    host = e.tiers.host
    assert host.num_slots < 10 and host.num_used <= host.num_slots
    assert host.evicted > 0


def _reserve(path, total, nbytes, q):
    try:
        NodeBudget(total, path).reserve(nbytes)
        q.put("ok")
        time.sleep(3)  # hold it while the other process tries
    except BudgetExceeded as e:
        q.put(str(e))


def test_node_budget_is_shared_between_processes(tmp_path):
    path = tmp_path / "budget.json"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    a = ctx.Process(target=_reserve, args=(path, 1000, 700, q))
    a.start()
    assert q.get(timeout=20) == "ok"
    b = ctx.Process(target=_reserve, args=(path, 1000, 400, q))
    b.start()
    msg = q.get(timeout=20)
    assert "does not fit the node host-memory budget" in msg and "700" not in msg.split("(")[0]
    b.join()
    a.join()
    # a dead holder's share is reclaimed
    NodeBudget(1000, path).reserve(900)


def test_engine_refuses_a_host_tier_over_the_node_budget(tiny_qwen3):
    with pytest.raises(BudgetExceeded, match="node host-memory budget"):
        LLM(str(tiny_qwen3), page_size=8, num_pages=64, host_cache_gb=0.5, node_host_memory_gb=0.1)


def test_metrics_export_the_host_tier(tiny_qwen3):
    """/metrics reads the tier counters at scrape time (through the engine loop)."""
    import asyncio

    from trnd.api.metrics import Metrics
    from trnd.engine.loop import EngineLoop

    _, engine = run(tiny_qwen3, workload(), num_pages=24, host_cache_gb=0.01)
    loop = EngineLoop(engine).start()
    try:
        text = asyncio.run(Metrics("m").render(loop)).decode()
    finally:
        loop.stop()
    host = engine.tiers.host
    assert f'trnd:kv_tier_loaded_pages_total{{model_name="m",tier="host"}} {float(host.loaded)}' in text
    assert host.loaded > 0
    assert 'trnd:kv_tier_load_latency_ms_p50{model_name="m",tier="host"}' in text


def test_decode_keeps_stepping_while_a_request_waits_for_host_pages(tiny_qwen3):
    """The copy back from L2 runs on the load thread: with that thread held, a running request keeps
    producing tokens while the revisiting one waits, parked, for its pages; then it completes with the
    same tokens as a big pool."""
    import threading

    prompts = workload()
    (want,), _ = run(tiny_qwen3, [prompts[4]], num_pages=512)
    llm = LLM(str(tiny_qwen3), page_size=8, max_batch=4, num_pages=48, host_cache_gb=0.01)
    for p in prompts[:4]:  # four histories through a pool that holds two: the first goes down to L2
        llm.generate([p], GREEDY)
    e = llm.engine
    gate = threading.Event()
    e.tiers.host._load.submit(gate.wait)  # the load thread is busy until the gate opens
    runner = e.add([3] * 20, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    revisit = e.add(prompts[4], GREEDY)  # session 0's next turn: its history is in L2 only
    got: dict[str, list[int]] = {runner.rid: [], revisit.rid: []}
    for _ in range(12):
        for out in e.step():
            got[out.rid] += out.token_ids
    assert revisit.rid in e.scheduler.parked and e.scheduler.parked[revisit.rid].tier == "host"
    assert len(got[runner.rid]) >= 10 and got[revisit.rid] == []
    gate.set()
    while revisit.status.name != "FINISHED" or runner.status.name != "FINISHED":
        for out in e.step():
            got[out.rid] += out.token_ids
    assert got[revisit.rid] == want
    assert revisit.num_loaded >= 160 - 8  # its history came from L2, not recomputed
    e.poll()
    e.check_integrity()
    assert e.tiers.host.stats()["pinned_slots"] == 0


def test_host_slots_under_a_copy_are_neither_evicted_nor_half_visible():
    """A slot being read stays put while puts churn the LRU; a page being saved is not found until its
    copy is done."""
    import threading

    from trnd.cache.host import HostTier

    pool = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4)
    host = HostTier([pool], num_slots=4)
    keys = [bytes([i]) for i in range(16)]
    host.put(keys[:4], [0, 1, 2, 3])
    gate = threading.Event()
    host._load.submit(gate.wait)
    fut = host.load(keys[:1], [15])  # queued behind the gate: slot of keys[0] pinned
    host.put(keys[4:8], [4, 5, 6, 7])  # wants all four slots: only three are free to take
    assert host.probe(keys[:1]) == 1 and host.stats()["pinned_slots"] == 1
    host._save.submit(gate.wait)
    saving = host.put_async(keys[8:9], [8])
    assert host.probe(keys[8:9]) == 0 and not saving.done()
    gate.set()
    assert fut.result(5) == 1 and torch.equal(pool[15], pool[0])
    assert saving.result(5) == 1 and host.probe(keys[8:9]) == 1
    assert host.stats()["pinned_slots"] == 0 and host.num_used <= 4
    host.close()


def test_decode_role_admission_loads_host_pages_before_asking_prefill():
    """On a decode server (remote prefill) the prompt's pages found in L2 are copied back first; only
    the rest is reserved for the prefill peer, which skips what decode already holds."""
    from trnd.cache.host import HostTier
    from trnd.cache.pages import PagePool
    from trnd.cache.radix import RadixCache
    from trnd.cache.tiers import Tiers
    from trnd.engine.parked import Parked
    from trnd.engine.request import Req
    from trnd.engine.scheduler import Scheduler, SchedulerConfig

    ps = 4
    kv = torch.zeros(16, 8)
    pool = PagePool(16)
    radix = RadixCache(pool, ps)
    tiers = Tiers(radix, pool, ps, "ns", HostTier([kv], 8))
    s = Scheduler(SchedulerConfig(page_size=ps, token_budget=64, chunk_size=64), pool, radix)
    s.tiers = tiers
    asked = []

    class FromPeer(Parked):
        phase = "waiting_for_kv"

        def done(self):
            return False

    def ask_peer(req):
        asked.append(req)
        return FromPeer(req)
    s.peer = ask_peer
    prompt = list(range(100, 114))  # 14 tokens: 3 full pages of history (the last token is never matched)
    kv[13:16] = torch.arange(3.0)[:, None] + 1  # a former request's pages, written down to L2 ...
    tiers.host.put(tiers.hashes(prompt[:-1]), [13, 14, 15])
    kv[13:16] = 0  # ... and since overwritten on the device
    r = Req(prompt, GREEDY)
    s.add(r)
    b = s.schedule()
    assert not asked and s.parked[r.rid].tier == "host"  # parked on the copy, not sent to prefill yet
    s.parked[r.rid].fut.result(5)
    b = s.schedule()
    assert asked == [r] and isinstance(s.parked[r.rid], FromPeer) and b.empty
    assert r.num_cached == 12 and len(r.pages) == 4  # 3 pages loaded + 1 page for the prefill peer to write
    assert [kv[p, 0].item() for p in r.pages[:3]] == [1.0, 2.0, 3.0]
    tiers.close()


def test_host_copies_more_pages_than_one_gather_chunk_in_both_directions():
    """Pages go to L2 and back COPY_CHUNK at a time (the temporary stays small): every page of a put larger
    than several chunks lands in its slot, and a load brings each back to the page asked, in order."""
    from trnd.cache.host import COPY_CHUNK, HostTier

    n = 3 * COPY_CHUNK + 5
    pools = [torch.randn(2 * n, 3, 8), torch.randn(2 * n, 3, 8)]  # two ranks' pools
    want = [p[:n].clone() for p in pools]
    host = HostTier(pools, num_slots=n)
    keys = [i.to_bytes(4, "little") for i in range(n)]
    assert host.put(keys, list(range(n))) == n
    dst = list(range(2 * n - 1, n - 1, -1))  # into other pages, reversed
    assert host.load(keys, dst).result(10) == n
    for p, w in zip(pools, want):
        assert torch.equal(p[dst], w)
    host.close()
