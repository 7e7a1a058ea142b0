"""A hostile client and a hung target against `trnd router` (issues 47 and 56), real processes on loopback: a
client's strings never reach an upstream header as sent nor count against a target; bodies of the wrong shape
are the decode servers' 400s; the router's memory stays bounded after many distinct session ids and after
huge prompts (RSS from /proc); a target SIGSTOPped mid-stream ends the client's stream with an error event and
[DONE] once the probes take it out, not after request_timeout_s."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest

from tests.launch import Server, stop
from tests.procs.test_faults import rss_mb
from tests.system.test_router import start_router

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backends(tiny_qwen3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-hostile")
    servers = [Server(tiny_qwen3, tmp, "--aggregated", max_model_len=1024) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(backends, tiny_qwen3, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("router-cfg") / "router.toml"
    cfg.write_text("probe_s = 0.5\n")
    proc, port = start_router([f"127.0.0.1:{s.port}" for s in backends], "--config", str(cfg), model=tiny_qwen3)
    yield proc, port
    stop(proc)


def chat(port: int, body: dict, headers=None, timeout=60) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers, timeout=timeout,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})


def metric(port: int, name: str) -> float:
    """The sum of a series' samples; name may carry labels (name{a="b"}), matched in any order among others
    (prometheus_client writes them sorted, model_name among them)."""
    base, _, want = name.partition("{")
    want = [w for w in want.rstrip("}").split(",") if w]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if (ln.startswith(base + "{") or ln.startswith(base + " ")) and all(w in ln for w in want))


def healthy(port: int) -> list[bool]:
    return [p["healthy"] for p in httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=10).json()["peers"]]


def raw_post(port: int, body: bytes, extra_headers: bytes) -> int:
    """A request with header bytes httpx would not send (a Latin-1 byte): its status."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra_headers
                  + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_client_strings_never_take_a_target_out(router):
    """Before: a session_id with a line break or a prompt_cache_key with a NUL (a decode server answers these
    200) failed the router's upstream request and counted against the target (17 requests, 39 failovers, healthy
    targets out, others 503); a non-ASCII session_id or a Latin-1 byte in x-session-id was a 500; 2 MB session
    ids were 503s."""
    _, port = router
    before = metric(port, "trnd:router_failovers_total")
    for body in ({"session_id": "a\nb"}, {"session_id": "x\r\nX-Evil: 1"}, {"prompt_cache_key": "k\u0000"},
                 {"session_id": "sesión-☃"}, {"session_id": "s" * 2 * 2**20}, {"prompt_cache_key": "p" * 2**20}):
        for _ in range(3):
            r = chat(port, body)
            assert r.status_code == 200, (list(body), r.text[:300])
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    assert raw_post(port, body, b"x-session-id: caf\xe9\r\n") == 200
    assert metric(port, "trnd:router_failovers_total") == before
    assert all(healthy(port))


@pytest.mark.parametrize("body, param", [
    ({"messages": 5}, "messages"), ({"messages": True}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens"),
])
def test_bodies_of_the_wrong_shape_are_the_decode_servers_400(router, backends, body, param):
    """Before: 500 from the router where the decode servers answer 400."""
    _, port = router
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
    direct = httpx.post(f"{backends[0].url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == direct.status_code == 400, (r.text, direct.text)
    assert r.json()["error"]["param"] == direct.json()["error"]["param"]
    assert param in (r.json()["error"]["param"] or "")


def test_many_session_ids_and_huge_prompts_leave_the_router_bounded(router):
    """Before: 4,000 distinct 62 KB session ids grew the router by 214-233 MB (every id kept as sent), and four
    3.5 MB chat prompts tokenized on its event loop left its RSS at 1.6-1.8 GB. Ids are hashed on entry into an
    LRU of max_sessions; a prompt is tokenized off the loop, in pieces, at most max_tokenize_chars of it."""
    proc, port = router
    chat(port, {"session_id": "warm"})
    base = rss_mb(proc.pid)
    with httpx.Client(timeout=60) as c:
        for i in range(1500):
            r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                             "session_id": f"{i:06d}" + "x" * 62_000})
            assert r.status_code == 200
    grew_sessions = rss_mb(proc.pid) - base
    state = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=10).json()
    kept = metric(port, 'trnd:router_map_entries{map="sessions"}')
    assert sum(p["sessions"] for p in state["peers"]) == kept >= 1501
    huge = "word " * (700 * 1024)  # 3.5 MB
    for _ in range(4):
        r = chat(port, {"messages": [{"role": "user", "content": huge}]}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    grew = rss_mb(proc.pid) - base
    assert grew_sessions < 40 and grew < 200, (grew_sessions, grew)  # 1,500 ids of 62 KB are 93 MB as sent


def test_a_hung_target_ends_its_stream_with_an_error_and_done(router, backends):
    """Before: a SIGSTOPped decode server held the router's stream for request_timeout_s (600 s), even after the
    probes had marked it unhealthy. Now the stream ends once the probes take the target out (fail_after x
    probe_s + probe_timeout_s) and it stays silent: an error event, then [DONE]."""
    _, port = router
    body = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    events, victim = [], None
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(60.0)) as r:
            assert r.status_code == 200
            target = r.headers["x-trnd-target"]
            victim = next(s for s in backends if target.endswith(f":{s.port}"))
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:
                    victim.proc.send_signal(signal.SIGSTOP)
    finally:
        if victim is not None:
            victim.proc.send_signal(signal.SIGCONT)
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2].removeprefix("data: "))
    assert err["error"]["code"] == "upstream_failed", err
    assert len(events) < 900
    deadline = time.monotonic() + 30  # it answers again: back in rotation, and the router serves on
    while not all(healthy(port)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert chat(port, {}).status_code == 200
