"""Routing on real caches (issue 52): `trnd router --kv-events` subscribes to its targets' KV events and sends a
prompt to the server that holds its prefix, even one the router never routed (the server was sent it
directly); a stale or absent feed is an alarm (metrics, log), never a silent fallback; and the prefill leg
goes to the prefill server holding the prefix."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from trnd.events import wire
from trnd.events.hashes import VllmHasher
from trnd.router.events import EventRouting, KVIndex

from tests.launch import Server, stop, wait_for
from tests.procs.test_disagg import prompts
from tests.system.test_router import start_router

EVENTS = json.dumps({"enable_kv_cache_events": True})


def stored(hashes, tokens=(), parent=None) -> wire.BlockStored:
    return wire.BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                            block_size=2, lora_id=None, medium="GPU", lora_name=None)


def test_the_index_follows_stores_removals_and_clears():
    idx = KVIndex()
    h = VllmHasher().chain(None, [1, 2, 3, 4, 5, 6], 2)
    idx.apply("a", wire.KVEventBatch(ts=0, events=[stored(h)]))
    idx.apply("b", wire.KVEventBatch(ts=0, events=[stored(h[:1])]))
    assert idx.longest(h, {"a", "b"}) == ("a", 3)
    assert idx.longest(h, {"b"}) == ("b", 1)
    idx.apply("a", wire.KVEventBatch(ts=0, events=[wire.BlockRemoved(block_hashes=[h[1]], medium="GPU")]))
    assert idx.longest(h, {"a"}) == ("a", 1)  # a leading run only
    idx.apply("a", wire.KVEventBatch(ts=0, events=[wire.AllBlocksCleared()]))
    assert idx.longest(h, {"a"}) == (None, 0) and idx.size("a") == 0 and idx.longest(h, {"a", "b"}) == ("b", 1)


def test_a_target_without_a_feed_is_an_alarm_not_a_silent_fallback(caplog):
    ev = EventRouting(page_size_hint=2)
    try:
        ev.sync("10.0.0.1:8000", None)  # it publishes no events
        caplog.set_level(logging.WARNING, logger="trnd.router")
        view = ev.view()
        assert view.longest(ev.blocks_of([1, 2, 3, 4, 5], None), {"10.0.0.1:8000"}) == (None, 0)
        assert ev.unusable == 1 and ev.stats()["10.0.0.1:8000"]["state"] == "down"
        assert any("kv index unusable" in r.getMessage() and "publishes no KV events" in r.getMessage()
                   for r in caplog.records)
    finally:
        ev.close()


def completion(url: str, prompt, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


@pytest.fixture(scope="module")
def servers(tiny_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-events")
    s = [Server(tiny_qwen3, tmp, "--aggregated", "--kv-events-config", EVENTS, max_model_len=1024) for _ in range(2)]
    yield s
    for x in s:
        x.stop()


def metric(port: int, name: str, **labels) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name) and want in line:
            return float(line.split()[-1])
    return float("nan")


@pytest.mark.slow
def test_trnd_router_routes_on_the_targets_real_caches(servers, tiny_qwen3):
    a, b = servers
    proc, port = start_router([f"127.0.0.1:{s.port}" for s in servers], "--kv-events", model=tiny_qwen3)
    try:
        addrs = [f"127.0.0.1:{s.port}" for s in servers]
        assert wait_for(lambda: all(metric(port, "trnd:router_kv_feed_ok", target=x) == 1 for x in addrs), 30)
        # two histories, each sent straight to one server: the router never saw them
        ha, hb = prompts([200], seed=31)[0], prompts([200], seed=32)[0]
        completion(a.url, ha)
        completion(b.url, hb)
        assert wait_for(lambda: metric(port, "trnd:router_kv_index_blocks", target=addrs[1]) >= 12, 10)
        for history, holder in ((ha, addrs[0]), (hb, addrs[1]), (hb, addrs[1]), (ha, addrs[0])):
            r = completion(f"http://127.0.0.1:{port}", history + prompts([20], seed=33)[0])
            assert (r.headers["x-trnd-target"], r.headers["x-trnd-route"]) == (holder, "prefix")
            assert cached(r) >= 192
        assert metric(port, "trnd:router_kv_routes_total", outcome="hit") >= 4
        # the holder drops its cache: BlockRemoved reaches the index, the prompt is no one's prefix any more
        assert httpx.post(f"{a.url}/admin/evict", timeout=30).status_code == 200
        assert wait_for(lambda: metric(port, "trnd:router_kv_index_blocks", target=addrs[0]) == 0, 10)
        r = completion(f"http://127.0.0.1:{port}", ha + [7, 7])
        assert r.headers["x-trnd-route"] == "load"
    finally:
        stop(proc)


@pytest.mark.slow
def test_the_prefill_leg_goes_to_the_prefill_server_holding_the_prefix(tiny_qwen3, tmp_path):
    """Two prefill servers behind one decode server: the router reads both prefills' events (their endpoints
    from decode's /admin/state) and tells decode which one holds the prompt's prefix (x-trnd-prefill); decode
    hands the prompt to it, which computes only the new tokens. Without the hint decode takes the least
    loaded one (the first, on a tie): here the other one."""
    from tests.procs.test_disagg import Deployment

    secret = tmp_path / "secret"
    secret.write_text("events-secret-0123456789")
    ev = ("--kv-events-config", EVENTS)
    d = Deployment(tiny_qwen3, secret, n_prefill=2, prefill_extra=ev, decode_extra=ev)
    proc = None
    try:
        peers = [p["addr"] for p in httpx.get(f"http://127.0.0.1:{d.port}/admin/state", timeout=10).json()["peers"]]
        history = prompts([300], seed=41)[0]
        # the history is prefilled on the second prefill server (decode honours the hint from anyone)
        r = httpx.post(f"http://127.0.0.1:{d.port}/v1/completions", headers={"x-trnd-prefill": peers[1]},
                       json={"prompt": history, "max_tokens": 2, "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        proc, port = start_router([f"127.0.0.1:{d.port}"], "--kv-events", model=tiny_qwen3)
        feed = f"prefill:{peers[1]}"
        assert wait_for(lambda: metric(port, "trnd:router_kv_index_blocks", target=feed) >= 18, 30)
        before = httpx.get(f"http://127.0.0.1:{d.prefills[1][2]}/admin/state", timeout=10).json()["stats"]
        r = completion(f"http://127.0.0.1:{port}", history + prompts([30], seed=42)[0])
        after = httpx.get(f"http://127.0.0.1:{d.prefills[1][2]}/admin/state", timeout=10).json()["stats"]
        assert cached(r) >= 288  # the history's pages came from the second prefill server's cache
        assert after["prefill_tokens"] - before["prefill_tokens"] <= 30 + 16 + 2
        state = httpx.get(f"http://127.0.0.1:{d.port}/admin/state", timeout=10).json()
        assert state["transfers"]["prefill_by_prefix"] >= 1
        assert metric(port, "trnd:router_kv_routes_total", outcome="prefill_hit") >= 1
    finally:
        if proc is not None:
            stop(proc)
        d.close()
