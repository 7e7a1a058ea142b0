"""`trnd router` in front of two real decode fronts (aggregated `trnd serve` processes), driven by the
official openai client: session affinity, spreading, streaming, failover on SIGKILL, fit, auth."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.launch import free_port, start_store, stop, wait_ready
from tests.system.test_api_openai import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backends(tiny_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    servers = [Server(tiny_qwen3, tmp, "--aggregated", max_model_len=1024) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def start_router(targets: list[str], *extra: str, model=None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "trnd", "router", "--port", str(port), *sum((["--target", t] for t in targets), []),
           *extra]
    if model is not None:
        cmd += ["--model", str(model)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_ready(port, proc, timeout=60)
    return proc, port


@pytest.fixture(scope="module")
def router(backends, tiny_qwen3):
    proc, port = start_router([f"127.0.0.1:{s.port}" for s in backends], model=tiny_qwen3)
    yield port
    stop(proc)


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


def chat_turn(c: openai.OpenAI, history: list[dict], session: str) -> tuple[str, str, int]:
    raw = c.chat.completions.with_raw_response.create(model=c.models.list().data[0].id, messages=history,
                                                      max_tokens=8, extra_body={"session_id": session})
    reply = raw.parse()
    history.append({"role": "assistant", "content": reply.choices[0].message.content})
    cached = reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0
    return raw.headers["x-trnd-target"], raw.headers["x-trnd-route"], cached


def test_models_come_from_the_targets(router, backends):
    cards = client(router).models.list().data
    assert len(cards) == 1 and cards[0].model_extra["max_model_len"] == 1024


def test_a_session_stays_on_one_server_and_hits_its_cache(router):
    c = client(router)
    history = [{"role": "system", "content": "You are a terse assistant. " * 8}]
    seen = []
    for turn in range(3):
        history.append({"role": "user", "content": f"Turn {turn}: tell me about the sea, the sky and the hills."})
        seen.append(chat_turn(c, history, "conv-1"))
    assert len({t for t, _, _ in seen}) == 1 and all(r == "session" for _, r, _ in seen)
    assert seen[1][2] > 0 and seen[2][2] > 0  # turns 2-3 found the conversation in that server's prefix cache


def test_prompt_cache_key_routes_as_a_session(router):
    """OpenAI's prompt_cache_key stands for session_id at the router as on the servers."""
    c = client(router)
    seen = set()
    for turn in range(3):
        raw = c.chat.completions.with_raw_response.create(
            model=c.models.list().data[0].id, messages=[{"role": "user", "content": f"turn {turn}"}], max_tokens=2,
            extra_body={"prompt_cache_key": "pck-1"})
        seen.add((raw.headers["x-trnd-target"], raw.headers["x-trnd-route"]))
    assert len(seen) == 1 and next(iter(seen))[1] == "session"


def test_sessions_spread_over_both_servers(router, backends):
    c = client(router)
    where = {chat_turn(c, [{"role": "user", "content": "hi"}], f"spread-{i}")[0] for i in range(12)}
    assert where == {f"127.0.0.1:{s.port}" for s in backends}


def test_streaming_passes_through_and_equals_non_streamed(router):
    c = client(router)
    kw = dict(model=c.models.list().data[0].id, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = c.completions.create(**kw).choices[0].text
    parts = [ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(parts) == whole and len(parts) > 1


def test_too_long_for_every_server_is_400_with_the_numbers(router):
    with pytest.raises(openai.BadRequestError) as e:
        client(router).completions.create(model="m", prompt="word " * 50, max_tokens=5000)
    assert "largest context served is 1024" in str(e.value)


def test_bad_json_is_an_openai_400(router):
    r = httpx.post(f"http://127.0.0.1:{router}/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # past msgspec's nesting limit, in a field that takes any JSON (a schema): invalid JSON, never a 500
    n = 100_000
    deep = (b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
            + b'{"a": ' * n + b"1" + b"}" * n + b"}}}")
    r = httpx.post(f"http://127.0.0.1:{router}/v1/completions", content=deep, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # nested where the body's type stops it first: the decode servers' own 400 naming the field (check_body)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"http://127.0.0.1:{router}/v1/completions", content=deep, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    assert r.json()["error"]["param"].startswith("prompt[0]")  # prompt[0][0]: a batch of token lists


def test_router_state_and_metrics(router):
    chat_turn(client(router), [{"role": "user", "content": "state"}], "state-session")
    s = httpx.get(f"http://127.0.0.1:{router}/admin/state", timeout=10).json()
    assert s["role"] == "router" and len(s["peers"]) == 2 and all(t["healthy"] for t in s["peers"])
    assert s["routing"]["session"] > 0 and s["peers"][0]["max_model_len"] == 1024
    from trnd import snapshot

    assert snapshot.decode(s).routing.session == s["routing"]["session"]  # the schema trnd top decodes
    m = httpx.get(f"http://127.0.0.1:{router}/metrics", timeout=10).text
    routed = [ln for ln in m.splitlines() if ln.startswith("trnd:router_requests_total{")]  # labels in any order
    assert [ln for ln in routed if 'model_name="tiny-qwen3"' in ln and 'route="session"' in ln and 'target="' in ln], m
    assert "trnd:router_target_healthy" in m and "_created" not in m
    samples = [ln for ln in m.splitlines() if ln.startswith("trnd:")]
    assert samples and all('model_name="tiny-qwen3"' in ln for ln in samples), samples


def test_sigkill_of_one_server_moves_its_sessions_without_5xx(tiny_qwen3, tmp_path):
    servers = [Server(tiny_qwen3, tmp_path, "--aggregated", max_model_len=1024) for _ in range(2)]
    proc, port = start_router([f"127.0.0.1:{s.port}" for s in servers], "--log-level", "warning")
    try:
        c = client(port)
        homes = {f"s{i}": chat_turn(c, [{"role": "user", "content": "hello"}], f"s{i}")[0] for i in range(8)}
        victim = servers[0]
        moved = [s for s, addr in homes.items() if addr == f"127.0.0.1:{victim.port}"]
        assert moved, homes
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        t0 = time.monotonic()
        for s in moved:  # each is served by the survivor: the first may fail over inside the router
            target, _, _ = chat_turn(c, [{"role": "user", "content": "hello again"}], s)
            assert target == f"127.0.0.1:{servers[1].port}"
        assert time.monotonic() - t0 < 60
        state = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=10).json()
        dead = next(t for t in state["peers"] if t["addr"] == f"127.0.0.1:{victim.port}")
        assert not dead["healthy"]
        servers[1].wait_idle()  # nothing leaked on the survivor
    finally:
        stop(proc)
        for s in servers:
            s.stop()


def test_router_api_key_and_reload(backends, tmp_path):
    """The router's life is every role's (daemon/lifecycle.py): SIGHUP re-reads its config and applies the
    key and the targets live, /health follows its event loop, SIGTERM drains and exits 0."""
    addrs = [f"127.0.0.1:{s.port}" for s in backends]
    conf = tmp_path / "router.toml"
    conf.write_text(f'api_key = "k1"\ntargets = {addrs!r}\n'.replace("'", '"'))
    proc, port = start_router([], "--config", str(conf))
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=10)
        assert r.status_code == 200
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["status"] == "ok" and health["last_progress_s"] < 5
        conf.write_text(f'api_key = "k2"\ntargets = ["{addrs[0]}"]\n')
        proc.send_signal(signal.SIGHUP)
        k2 = {"Authorization": "Bearer k2"}
        deadline = time.time() + 20
        while httpx.get(f"{url}/admin/state", headers=k2, timeout=10).status_code != 200:
            assert time.time() < deadline, "the reload did not apply the new key"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=10).status_code == 401
        peers = httpx.get(f"{url}/admin/state", headers=k2, timeout=10).json()["peers"]
        assert [p["addr"] for p in peers] == [addrs[0]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop(proc)


def test_a_moved_session_loads_its_history_from_the_l3_store(tiny_qwen3, tmp_path):
    """Its server dies; the session's next turn lands on the other server, which loads the conversation's
    pages from the shared store instead of recomputing them."""
    from tests.procs.test_disagg import prompts

    secret = tmp_path / "secret"
    secret.write_text("l3-secret-0123456789")
    store, cp, _ = start_store(secret)
    extra = ("--aggregated", "--config", str(tmp_path / "l3.toml"))
    (tmp_path / "l3.toml").write_text(f'store = ["127.0.0.1:{cp}"]\nsecret_file = "{secret}"\n')
    servers = [Server(tiny_qwen3, tmp_path, *extra, max_model_len=1024) for _ in range(2)]
    proc, port = start_router([f"127.0.0.1:{s.port}" for s in servers], "--log-level", "warning")
    try:
        def turn(prompt: list[int], n: int) -> tuple[str, dict]:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, headers={"x-session-id": "l3"},
                           json={"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.headers["x-trnd-target"], r.json()

        history = prompts([400], seed=31)[0]
        home, _ = turn(history, 8)
        a = next(s for s in servers if f"127.0.0.1:{s.port}" == home)
        b = next(s for s in servers if s is not a)
        deadline = time.monotonic() + 10
        while a.state()["tiers"]["remote"]["pages_written"] == 0:
            assert time.monotonic() < deadline, "turn 1's pages never reached the store"
            time.sleep(0.1)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        before = b.state()["stats"]["loaded_tokens"]
        where, _ = turn(history + prompts([20], seed=32)[0], 4)
        assert where == f"127.0.0.1:{b.port}"
        assert b.state()["stats"]["loaded_tokens"] - before >= 16 * 20  # most of the 400-token history
    finally:
        stop(proc)
        for s in servers:
            s.stop()
        stop(store)


def test_vllm_router_fronts_trnd_decode_servers_unchanged(backends):
    """Interop: vllm-router (its plain mode, consistent-hash policy) in front of two trnd servers; the
    openai client works through it."""
    exe = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(exe).exists():
        pytest.skip("vllm-router is not installed (pip install vllm-router: a test extra)")
    port = free_port()
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash",
                             "--worker-urls", *[f"http://127.0.0.1:{s.port}" for s in backends],
                             "--health-check-endpoint", "/health", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, c = time.monotonic() + 60, client(port)
        while True:
            assert proc.poll() is None, stop(proc)
            try:
                model = c.models.list().data[0].id
                break
            except (openai.APIConnectionError, openai.APIStatusError, IndexError):
                assert time.monotonic() < deadline, "vllm-router never answered /v1/models"
                time.sleep(0.5)
        reply = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1
        parts = [ch for ch in c.completions.create(model=model, prompt="Once", max_tokens=4, stream=True)]
        assert parts
    finally:
        stop(proc)


def test_serve_prefill_2_decode_2_sessions_and_failover(tiny_qwen3):
    """The local xPyD deployment in one command: 2 prefill servers, 2 decode servers, the router on the API
    port. A session's turns stay on one decode server and hit its cache; sessions spread; SIGKILL of a decode
    server moves its sessions to the other with no 5xx, and nothing leaks."""

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--port", str(port),
                             "--prefill", "2", "--decode", "2", "--threads", "1", "--kv-memory-gb", "0.1",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = proc.stdout.readline()
        pids = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(r"(\w+) pid (\d+) \(http://127.0.0.1:(\d+)\)", banner)}
        assert set(pids) == {"prefill0", "prefill1", "decode0", "decode1", "router"}, banner
        deadline = time.monotonic() + 180
        while True:  # every decode server healthy behind the router
            assert proc.poll() is None
            try:
                s = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=5).json()
                if all(t["healthy"] for t in s["peers"]):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the deployment never became healthy"
            time.sleep(0.5)
        # the whole deployment from its front port: the router names its decode servers, they their prefills
        top = subprocess.run([sys.executable, "-m", "trnd", "top", "--once", f"http://127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=60)
        assert top.returncode == 0, top.stdout + top.stderr
        for name, (_, node_port) in pids.items():
            assert f"127.0.0.1:{node_port}" in top.stdout, (name, top.stdout)
        c = client(port)
        history = [{"role": "system", "content": "You are a terse assistant. " * 8}]
        seen = []
        for turn in range(3):
            history.append({"role": "user", "content": f"Turn {turn}: tell me about the sea and the hills."})
            seen.append(chat_turn(c, history, "conv"))
        assert len({t for t, _, _ in seen}) == 1 and seen[1][2] > 0 and seen[2][2] > 0
        homes = {f"s{i}": chat_turn(c, [{"role": "user", "content": "hi"}], f"s{i}")[0] for i in range(10)}
        decode_ports = {pids[n][1]: n for n in ("decode0", "decode1")}
        assert {int(a.rsplit(":", 1)[1]) for a in homes.values()} == set(decode_ports)
        victim_port = int(seen[0][0].rsplit(":", 1)[1])
        survivor = next(p for p in decode_ports if p != victim_port)
        import os
        os.kill(pids[decode_ports[victim_port]][0], signal.SIGKILL)
        t0 = time.monotonic()
        moved = [s for s, a in homes.items() if a.endswith(f":{victim_port}")] + ["conv"]
        for s in moved:  # not one 5xx: the router retries a request that had not started on the survivor
            assert chat_turn(c, [{"role": "user", "content": "again"}], s)[0] == f"127.0.0.1:{survivor}"
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while True:  # the survivor returns every page to free (cached pages are evictable, not in use)
            st = httpx.get(f"http://127.0.0.1:{survivor}/admin/state", timeout=5).json()
            if not st["running"] and not st["waiting"] and st["pages"]["in_use"] == 0:
                break
            assert time.monotonic() < deadline, st["pages"]
            time.sleep(0.1)
    finally:
        stop(proc, timeout=60)


def test_trnd_top_shows_the_router_and_its_targets(router, backends):
    out = subprocess.run([sys.executable, "-m", "trnd", "top", "--once", f"http://127.0.0.1:{router}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "router" in out.stdout
    for s in backends:
        assert f"127.0.0.1:{s.port}" in out.stdout
    assert "sessions" in out.stdout


def test_client_disconnect_aborts_the_request_on_its_server(router, backends):
    """A client that leaves mid-stream: the router closes the upstream request, the decode server aborts it
    and frees its pages (nothing keeps generating for nobody)."""
    before = {s.port: s.state()["stats"]["aborted"] for s in backends}
    with httpx.stream("POST", f"http://127.0.0.1:{router}/v1/completions", timeout=60,
                      json={"prompt": "Once upon a time", "max_tokens": 900, "stream": True, "ignore_eos": True},
                      headers={"x-session-id": "leaver"}) as r:
        target = r.headers["x-trnd-target"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one token arrived: leave
    server = next(s for s in backends if target.endswith(f":{s.port}"))
    state = server.wait_idle(timeout=10)
    assert state["stats"]["aborted"] == before[server.port] + 1  # aborted, not run to its 900 tokens


def test_a_responses_conversation_stays_on_the_server_that_stores_it(router):
    """The router names a conversation (x-trnd-conversation); its response ids carry that key, so every
    follow-up by previous_response_id, and GET /v1/responses/{id}, reach the server holding it."""
    c = client(router)
    m = c.models.list().data[0].id
    raw = c.responses.with_raw_response.create(model=m, input="Hi", max_output_tokens=4)
    reply, target = raw.parse(), raw.headers["x-trnd-target"]
    for _ in range(3):
        raw = c.responses.with_raw_response.create(model=m, input="More", max_output_tokens=4,
                                                   previous_response_id=reply.id)
        assert raw.headers["x-trnd-target"] == target
        reply = raw.parse()
    assert c.responses.retrieve(reply.id).output_text == reply.output_text
    c.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(reply.id)
    url = f"http://127.0.0.1:{router}"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "Once upon"}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"] == "Once upon"
    assert httpx.get(f"{url}/version").json()["version"] == __import__("trnd").__version__
    assert c.models.retrieve(m).id == m
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
