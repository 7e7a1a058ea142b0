"""The path a request takes, observed: usage.prompt_tokens_details.cached_tokens counts every source
(this server's radix cache, L2, L3, a prefill peer's radix cache), each role logs one line per request
(and one per phase at debug), and /metrics on decode, prefill and store moves after real traffic:
requests, cached tokens by source, per-peer transfer bytes / latency / in flight, preemptions."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.launch import admin_state, free_port, stop, wait_for, wait_ready
from tests.procs.test_disagg import prompts
from tests.top import until

PAGE = 16


def start(args: list[str], log: Path) -> subprocess.Popen:
    """A real trnd process whose output goes to a file (debug logs outgrow a pipe nobody reads)."""
    f = log.open("w")
    return subprocess.Popen([sys.executable, "-m", "trnd", *args], stdout=f, stderr=subprocess.STDOUT, text=True)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m: dict, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, lbl), v in m.items() if n == name and set(labels.items()) <= set(lbl))


def lines(log: Path, rid: str) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if rid in ln]


class Disagg:
    """store + prefill (L3 on) + decode, debug logs to files."""

    def __init__(self, model, d: Path):
        secret = d / "secret"
        secret.write_text("obs-secret-0123456789")
        self.logs = {r: d / f"{r}.log" for r in ("store", "prefill", "decode")}
        scp, self.store_port = free_port(), free_port()
        self.store = start(["store", "--secret-file", str(secret), "--control-port", str(scp), "--admin-port",
                            str(self.store_port), "--memory-gb", "0.05"], self.logs["store"])
        cp, self.prefill_port, self.port = free_port(), free_port(), free_port()
        self.core_lock = d / "cores.lock"  # the two roles share this host's cores: they take turns
        common = ["--model", str(model), "--secret-file", str(secret), "--threads", "1", "--kv-memory-gb", "0.25",
                  "--log-level", "debug", "--core-lock", str(self.core_lock)]
        self.prefill = start(["prefill", *common, "--store", f"127.0.0.1:{scp}", "--control-port", str(cp),
                              "--admin-port", str(self.prefill_port)], self.logs["prefill"])
        self.decode = start(["decode", *common, "--prefill", f"127.0.0.1:{cp}", "--served-model-name", "m",
                             "--port", str(self.port), "--local-prefill-tokens", "0"],  # every prompt crosses
                            self.logs["decode"])
        try:
            for port, proc in ((self.store_port, self.store), (self.prefill_port, self.prefill), (self.port, self.decode)):
                wait_ready(port, proc)
        except BaseException:  # one never got ready: stop all three (the fixture's teardown never runs)
            self.close()
            raise
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0)

    def complete(self, prompt: list[int], user: str = "alice"):
        return self.client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, user=user,
                                              extra_body={"ignore_eos": True})

    def evict(self, port: int) -> None:
        assert httpx.post(f"http://127.0.0.1:{port}/admin/evict", timeout=10).status_code == 200

    def close(self) -> None:
        for p in (self.decode, self.prefill, self.store):
            stop(p)


@pytest.fixture(scope="module")
def disagg(tiny_qwen3, tmp_path_factory):
    d = Disagg(tiny_qwen3, tmp_path_factory.mktemp("obs"))
    yield d
    d.close()


def test_cached_tokens_count_every_source_across_roles_and_each_role_logs_the_request(disagg):
    prompt = prompts([300], seed=41)[0]
    hit = (len(prompt) - 1) // PAGE * PAGE  # full pages before the last token: what any cache can hold
    first = disagg.complete(prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # 1. decode's own radix cache (device)
    again = disagg.complete(prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == hit
    assert again.choices[0].text == first.choices[0].text
    # 2. decode forgot it; the prefill peer's radix cache still has it: prefill says so in KVDone
    disagg.evict(disagg.port)
    peer = disagg.complete(prompt)
    assert peer.usage.prompt_tokens_details.cached_tokens == hit
    # 3. both forgot it; prefill reads it from the L3 store (its finished prefills wrote it there)
    assert wait_for(lambda: admin_state(disagg.prefill_port)["tiers"]["remote"]["pages_written"] >= hit // PAGE)
    disagg.evict(disagg.port)
    disagg.evict(disagg.prefill_port)
    remote = disagg.complete(prompt, user="bob")
    assert remote.usage.prompt_tokens_details.cached_tokens == hit
    assert remote.choices[0].text == first.choices[0].text

    dlog, plog = disagg.logs["decode"], disagg.logs["prefill"]
    # the info line at the end, on decode: id, session, prompt, cached (by source), loaded (from where), ttft
    want = {first.id: (f"cached=0 [none] loaded={len(prompt)} [prefill_peer={len(prompt)}]", "alice"),
            again.id: (f"cached={hit} [device={hit}] loaded={len(prompt) - hit} [prefill_peer={len(prompt) - hit}]",
                       "alice"),
            peer.id: (f"cached={hit} [prefill={hit}] loaded={len(prompt)} [prefill_peer={len(prompt)}]", "alice"),
            remote.id: (f"cached={hit} [remote={hit}] loaded={len(prompt)} [prefill_peer={len(prompt)}]", "bob")}
    for rid, (kv, session) in want.items():
        done = [ln for ln in lines(dlog, rid) if " done: session=" in ln]  # the summary, not the timeline's "KV write 1 done:"
        assert len(done) == 1, lines(dlog, rid)
        assert "INFO" in done[0] and f"session={session} prompt={len(prompt)} {kv} ttft=" in done[0], done[0]
        assert "out=4" in done[0] and "finish=length" in done[0]
    # the phases at debug, on decode...
    trail = "\n".join(lines(dlog, remote.id))
    for phase in ("queued: 300 prompt tokens", "handed to prefill", "KV received from 127.0.0.1:",
                  f"300 tokens written, 12 computed there, its cache hits {{'remote': {hit}}}", "first token"):
        assert phase in trail, trail
    # ...and on prefill, which logs its own end line per prefill under the same id (p<peer>/<id>)
    ptrail = "\n".join(lines(plog, remote.id))
    assert f"{hit} tokens loaded from remote" in ptrail and "prefill start" in ptrail, ptrail
    pdone = [ln for ln in lines(plog, remote.id) if " done: session=" in ln]  # the summary, not the timeline's "KV write 1 done:"
    assert len(pdone) == 1 and f"session=bob prompt=300 cached={hit} [remote={hit}] loaded={hit} [remote={hit}]" \
        in pdone[0], pdone
    assert "out=1" in pdone[0]
    assert wait_for(lambda: admin_state(disagg.port)["pages"]["in_use"] == 0)


def test_metrics_on_decode_prefill_and_store_move_with_the_traffic(disagg):
    prompt = prompts([200], seed=42)[0]
    before = {r: scrape(p) for r, p in (("decode", disagg.port), ("prefill", disagg.prefill_port),
                                         ("store", disagg.store_port))}
    disagg.complete(prompt)
    assert wait_for(lambda: admin_state(disagg.prefill_port)["tiers"]["remote"]["pages_written"] > 0)
    time.sleep(0.3)  # the store's Commit round trip
    dec, pre, sto = scrape(disagg.port), scrape(disagg.prefill_port), scrape(disagg.store_port)

    def moved(m, role, name, by=None, **labels):
        d = total(m, name, **labels) - total(before[role], name, **labels)
        assert d > 0 if by is None else d == by, (role, name, labels, d)

    # decode: the request, its handoff received from the prefill peer, per peer
    moved(dec, "decode", "trnd:request_success_total", by=1, finished_reason="length")
    moved(dec, "decode", "trnd:kv_transfer_bytes_total", op="kv_receive")
    moved(dec, "decode", "trnd:kv_transfer_latency_seconds_count", by=1, op="kv_receive")
    moved(dec, "decode", "trnd:decode_handoffs_total", by=1)
    assert total(dec, "trnd:kv_transfers_in_flight") == 0
    assert total(dec, "trnd:num_preemptions_total") == 0
    # both roles took turns on the cores through the one lock file, and say how long they waited
    assert disagg.core_lock.exists()
    for m in (dec, pre):
        assert any(n == "trnd:core_lock_wait_seconds_total" for n, _ in m), sorted({n for n, _ in m})
    # the sources of the previous test's cached tokens, on decode
    for src in ("device", "prefill", "remote"):
        assert total(dec, "trnd:prompt_tokens_cached_total", source=src) >= 288, src
    # prefill: its requests and prompt tokens, its NIXL writes per decode agent, its L3 reads and writes
    moved(pre, "prefill", "trnd:prefill_requests_total", by=1)
    moved(pre, "prefill", "trnd:prompt_tokens_total", by=200)
    moved(pre, "prefill", "trnd:prefill_tokens_total", by=200)
    moved(pre, "prefill", "trnd:kv_transfer_bytes_total", op="kv_write")
    moved(pre, "prefill", "trnd:kv_transfer_bytes_total", op="store_write")
    peers = {dict(lbl)["peer"] for (n, lbl) in pre if n == "trnd:kv_transfer_bytes_total"
             and dict(lbl)["op"] == "kv_write"}
    assert len(peers) == 1 and next(iter(peers)).startswith("decode-"), peers
    assert total(pre, "trnd:kv_transfer_bytes_total", op="store_read") > 0  # the previous test's L3 hit
    assert total(pre, "trnd:prompt_tokens_cached_total", source="remote") >= 288
    assert ("trnd:num_requests_waiting", (("model_name", next(iter({dict(lbl)["model_name"] for (n, lbl) in pre
                                                                     if n == "trnd:num_requests_waiting"})),),)) in pre
    # store: slots and leases now, and per client: lookups, hits, bytes in, its side of every transfer
    assert total(sto, "trnd:store_slots", state="used") >= (288 + 192) // PAGE
    assert total(sto, "trnd:store_leases") == 0
    moved(sto, "store", "trnd:store_lookups_total")
    moved(sto, "store", "trnd:store_bytes_in_total")
    assert total(sto, "trnd:store_hits_total") > 0
    moved(sto, "store", "trnd:kv_transfer_bytes_total", op="accept_write")
    assert total(sto, "trnd:kv_transfer_bytes_total", op="serve_read") > 0
    assert total(sto, "trnd:kv_transfers_in_flight") == 0


@pytest.fixture(scope="module")
def aggregated(tiny_qwen3, tmp_path_factory):
    log = tmp_path_factory.mktemp("obs-agg") / "serve.log"
    port = free_port()
    proc = start(["serve", "--aggregated", "--model", str(tiny_qwen3), "--port", str(port), "--threads", "1",
                  "--kv-memory-gb", "0.004", "--host-cache-gb", "0.01", "--served-model-name", "m"], log)
    wait_ready(port, proc)
    yield port, log
    stop(proc)


def test_aggregated_counts_the_host_tier_and_preemptions(aggregated):
    port, log = aggregated
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    prompt = prompts([100], seed=43)[0]
    hit = (len(prompt) - 1) // PAGE * PAGE
    client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    assert httpx.post(f"http://127.0.0.1:{port}/admin/evict", timeout=10).status_code == 200  # pages -> L2
    r = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0, user="carol")
    assert r.usage.prompt_tokens_details.cached_tokens == hit
    done = [ln for ln in lines(log, r.id) if " done: session=" in ln]  # the summary, not the timeline's "KV write 1 done:"
    assert len(done) == 1 and f"session=carol prompt=100 cached={hit} [host={hit}] loaded={hit} [host={hit}]" in \
        done[0], done
    # preemption: requests whose tokens together outgrow the pool
    st = admin_state(port)
    cap = st["pages"]["token_capacity"]
    n, each = 3, min(st["limits"]["max_model_len"] - 8, int(cap * 0.6))
    assert n * each > cap * 1.3
    ps = prompts([32] * n, seed=44)

    def one(p):
        return client.completions.create(model="m", prompt=p, max_tokens=each - 32, temperature=0,
                                         extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        outs = list(ex.map(one, ps))
    assert all(o.usage.completion_tokens == each - 32 for o in outs)
    m = scrape(port)
    assert total(m, "trnd:num_preemptions_total") > 0
    assert total(m, "trnd:prompt_tokens_cached_total", source="host") == hit
    assert wait_for(lambda: admin_state(port)["pages"]["in_use"] == 0)
    ends = [ln for o in outs for ln in lines(log, o.id) if " done: session=" in ln]  # the summary, not the timeline's "KV write 1 done:"
    assert len(ends) == n and any("preemptions=0" not in ln for ln in ends), ends


def test_top_follows_one_request_across_decode_and_prefill(disagg):
    from textual.widgets import Static

    from trnd.top.app import TopApp
    from trnd.top.client import parse_target
    from trnd.top.trace import FollowScreen, TraceScreen

    r = disagg.complete(prompts([120], seed=45)[0], user="dave")
    nope = httpx.get(f"http://127.0.0.1:{disagg.port}/admin/requests/cmpl-nope", timeout=10)
    assert nope.status_code == 404 and nope.json()["error"]["code"] == "request_not_found"
    via_prefill = httpx.get(f"http://127.0.0.1:{disagg.prefill_port}/admin/requests/{r.id}", timeout=10).json()
    assert via_prefill["role"] == "prefill" and [t["id"] for t in via_prefill["traces"]] == [f"p1/{r.id}"]

    async def go():
        dec, pre = f"127.0.0.1:{disagg.port}", f"127.0.0.1:{disagg.prefill_port}"
        app = TopApp([parse_target(dec), parse_target(pre)], interval=0.3, timeout=5.0)
        async with app.run_test(size=(140, 50)) as pilot:
            assert await until(pilot, lambda: all(t.status == "ready" for t in app.tracks), 20)
            await pilot.press("f")
            assert await until(pilot, lambda: isinstance(app.screen, FollowScreen))
            await pilot.press(*[{"-": "minus"}.get(c, c) for c in r.id], "enter")  # typed, as a person would
            assert await until(pilot, lambda: isinstance(app.screen, TraceScreen))
            screen = app.screen
            assert screen.rid == r.id
            assert await until(pilot, lambda: len([a for _, a in screen.answers if a is not None]) == 2, 10)
            text = str(screen.query_one("#trace-detail", Static).render())
            # both nodes, each with its own id for the request, its summary and its phases in time order
            assert f"{dec} (decode, {r.id}): done" in text and f"{pre} (prefill, p1/{r.id}): done" in text, text
            # one time line: decode hands it over, prefill computes it, decode gets the KV and the first token
            path = text[text.index("path"):]
            order = ["decode    queued", "decode    handed to prefill", "prefill   queued", "prefill   prefill start",
                     "prefill   first token", "decode    KV received from", "decode    first token"]
            assert [path.index(p) for p in order] == sorted(path.index(p) for p in order), text
            assert "session dave" in text and "loaded 120 (prefill_peer=120)" in text and "finish length" in text
            await pilot.press("escape")
            assert await until(pilot, lambda: not isinstance(app.screen, TraceScreen))

    asyncio.run(go())


# -- the parts alone ----------------------------------------------------------------------------------

def test_a_preempted_request_does_not_count_its_own_recompute_as_cached():
    from trnd.cache.pages import PagePool
    from trnd.cache.radix import RadixCache
    from trnd.engine.request import Req, SamplingParams
    from trnd.engine.scheduler import Scheduler, SchedulerConfig

    pool = PagePool(32)
    s = Scheduler(SchedulerConfig(page_size=4, token_budget=8, chunk_size=8), pool, RadixCache(pool, 4))
    shared = list(range(12))
    a = Req(shared + [50, 51], SamplingParams(max_tokens=4))
    s.add(a)
    b = s.schedule()
    a.num_computed += b.prefill[0][1]  # 8 of 14 prompt tokens computed: 2 pages
    s.preempt(a)  # its 2 pages go to the radix cache; re-admitted, it finds them there
    s.schedule()
    assert a.num_cached == 8 and a.cached_tokens == 0 and a.cached_from == {}
    c = Req(shared + [60], SamplingParams(max_tokens=4))  # a new request on the same prefix: a real hit
    s.add(c)
    s.schedule()
    assert c.cached_tokens == 8 and c.cached_from == {"device": 8}


def test_peer_hits_count_what_lies_beyond_our_own_prefix():
    from trnd.roles.inbox import peer_hits

    assert peer_hits({"device": 32, "host": 16, "remote": 16}, 0) == {"prefill": 32, "host": 16, "remote": 16}
    assert peer_hits({"device": 32, "host": 16, "remote": 16}, 40) == {"host": 8, "remote": 16}
    assert peer_hits({"device": 32}, 32) == {}
    assert peer_hits({"remote": 64}, 16) == {"remote": 48}
    assert peer_hits({}, 16) == {}


def test_transfer_metrics_per_peer():
    from trnd.transfer.metrics import TransferMetrics

    m = TransferMetrics("m")
    m.start("kv_receive", "a:1", key="r1")
    m.start("kv_receive", "b:2", key="r2")
    m.start("kv_receive", "b:2", key="r3")
    t0 = m.start("kv_write", "dec-1")

    def val(name, **lbl):
        return total({(n, tuple(sorted(s.labels.items()))): s.value
                      for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
                      for n in [s.name]}, name, **lbl)
    assert val("trnd:kv_transfers_in_flight", op="kv_receive") == 3
    m.end("kv_receive", nbytes=100, key="r1")
    m.end("kv_receive", nbytes=100, key="r1")  # ended once only
    m.end("kv_receive", ok=False, key="r2")
    m.end("kv_receive", ok=None, key="r3")  # given up by its owner: neither bytes nor a failure
    m.end("kv_write", "dec-1", 64, t0=t0)
    assert val("trnd:kv_transfers_in_flight") == 0
    assert val("trnd:kv_transfer_bytes_total", op="kv_receive", peer="a:1") == 100
    assert val("trnd:kv_transfer_failures_total", peer="b:2") == 1
    assert val("trnd:kv_transfer_latency_seconds_count", peer="b:2") == 1
    assert val("trnd:kv_transfer_bytes_total", op="kv_write", peer="dec-1", model_name="m") == 64
