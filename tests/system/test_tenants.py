"""Tenant isolation (issue 52): vLLM's `cache_salt` and a default salt per API key key every tier's pages
(device, L2, L3), so tenant B asking A's prompt finds nothing of A's: `cached_tokens` 0, no page loaded from
any tier (counted in /metrics), with and without the router in front."""

from __future__ import annotations

import httpx
import pytest

from trnd.http.tenant import tenant_salt

from tests.launch import admin_state, stop, wait_for
from tests.launch import Server
from tests.procs.test_disagg import Deployment, prompts
from tests.procs.test_observability import scrape, total
from tests.system.test_router import start_router
from tests.procs.test_tiers_remote import start_store


def test_the_salt_is_the_key_and_the_body_salt():
    assert tenant_salt(None, None) is None  # single tenant: the shared space, as before
    assert tenant_salt(None, "a") == "a"  # vLLM's semantics without keys
    a, b = tenant_salt("key-a", None), tenant_salt("key-b", None)
    assert a and b and a != b  # a default salt per API key
    assert "key-a" not in a
    assert tenant_salt("key-a", "x") != tenant_salt("key-b", "x")  # another key's salt is out of reach
    assert tenant_salt("key-b", a) not in (a, None)  # sending A's salt with B's key reaches B's space only
    assert tenant_salt(b"key-a", "x") == tenant_salt("key-a", "x")


def cached(r: dict) -> int:
    return ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def post(port: int, prompt, salt: str | None, key: str | None = None, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_salt_must_be_a_nonempty_string(tiny_qwen3, tmp_path):
    s = Server(tiny_qwen3, tmp_path, "--aggregated")
    try:
        for bad in ("", 5, "x" * 257):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": bad})
            assert r.status_code == 400 and "cache_salt" in r.text, r.text
    finally:
        s.stop()


@pytest.mark.slow
def test_tenant_b_finds_nothing_of_a_in_l1_or_l3(tiny_qwen3, tmp_path):
    """Disaggregated (prefill + decode, both on a real `trnd store`): B's request for A's prompt is computed
    from scratch on a warm deployment (L1 of decode and prefill) and on a cold one that shares A's store (L3),
    while A's own repeat is served from those tiers."""
    secret = tmp_path / "secret"
    secret.write_text("tenant-secret-0123456789")
    store, cp, ap = start_store(secret)
    # a write that misses the store's deadline is dropped (a miss, by design); this test needs every page there,
    # so its roles wait for the store as long as a loaded CI host may take
    slow_ok = tmp_path / "store.toml"
    slow_ok.write_text("store_deadline_s = 30\n")
    extra = ("--store", f"127.0.0.1:{cp}", "--config", str(slow_ok))
    prompt = prompts([300], seed=5)[0]
    try:
        d = Deployment(tiny_qwen3, secret, decode_extra=extra, prefill_extra=extra)
        try:
            first = post(d.port, prompt, "tenant-a")
            assert cached(first) == 0
            assert cached(post(d.port, prompt, "tenant-a")) >= 256  # A's own prefix: found
            before = scrape(d.port)
            b = post(d.port, prompt, "tenant-b")
            assert cached(b) == 0 and b["choices"][0]["text"] == first["choices"][0]["text"]
            after = scrape(d.port)
            assert total(after, "trnd:prompt_tokens_cached_total") == total(before, "trnd:prompt_tokens_cached_total")
            assert total(after, "trnd:prefix_cache_salts") >= 2
            # both tenants' 18 full pages in the store (whichever role computed and wrote them)
            assert wait_for(lambda: admin_state(ap)["slots"]["used"] >= 36, timeout=60), admin_state(ap)
        finally:
            d.close()
        cold = Deployment(tiny_qwen3, secret, decode_extra=extra, prefill_extra=extra)
        try:
            before = scrape(cold.port)
            b = post(cold.port, prompt, "tenant-b2")  # a third tenant on A's store: nothing to load
            assert cached(b) == 0
            pst = admin_state(cold.prefills[0][2])
            assert pst["stats"]["loaded_tokens"] == 0
            assert total(scrape(cold.port), "trnd:kv_tier_loaded_pages_total") == \
                total(before, "trnd:kv_tier_loaded_pages_total")
            a = post(cold.port, prompt, "tenant-a")  # A on the cold deployment: its pages come from L3
            assert cached(a) >= 256 and a["choices"][0]["text"] == first["choices"][0]["text"]
            assert admin_state(cold.prefills[0][2])["stats"]["loaded_tokens"] >= 256
        finally:
            cold.close()
    finally:
        stop(store)


@pytest.mark.slow
def test_tenants_stay_apart_through_the_router_and_by_key(tiny_qwen3, tmp_path):
    """The router passes each client's salt on (salted with its own key) and keys its prefix routes by it;
    behind it the server salts again: B's request for A's prompt finds nothing, A's repeat does. A server
    with an API key gives its key a salt of its own even without cache_salt."""
    s = Server(tiny_qwen3, tmp_path, "--aggregated", max_model_len=1024, api_key="server-key")
    cfg = tmp_path / "router.toml"
    cfg.write_text('api_key = "router-key"\ntarget_api_key = "server-key"\n')
    proc, port = start_router([f"127.0.0.1:{s.port}"], "--config", str(cfg), model=tiny_qwen3)
    prompt = prompts([200], seed=6)[0]
    try:
        first = post(port, prompt, "a", key="router-key")
        assert cached(post(port, prompt, "a", key="router-key")) >= 192
        assert cached(post(port, prompt, "b", key="router-key")) == 0
        assert cached(post(port, prompt, None, key="router-key")) == 0  # the router's key alone: its own space
        direct = post(s.port, prompt, "a", key="server-key")  # the same body salt, not through the router
        assert cached(direct) == 0 and direct["choices"][0]["text"] == first["choices"][0]["text"]
        m = httpx.get(f"{s.url}/metrics", timeout=10).text
        salts = [ln for ln in m.splitlines() if ln.startswith("trnd:prefix_cache_salts")]
        assert salts and float(salts[0].split()[-1]) == 4, salts  # a, b, the router's key alone, direct a
    finally:
        stop(proc)
        s.stop()


def test_the_weights_enter_the_namespace(tiny_qwen3, tmp_path):
    """Same config and tokenizer, other weights (another seed): another key space in every tier."""
    import shutil

    from trnd.model.config import fingerprint, weights_identity
    from trnd.model.maker import make_model

    other = tmp_path / "other"
    make_model(other, preset="tiny", arch="qwen3", seed=1, dtype="float32")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_qwen3 / name, other / name)
    assert fingerprint(other) == fingerprint(tiny_qwen3)
    assert weights_identity(other) != weights_identity(tiny_qwen3)
    assert weights_identity(tiny_qwen3) == weights_identity(tiny_qwen3)
