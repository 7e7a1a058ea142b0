"""A hostile client against `trnd serve` (the default prefill + decode deployment): out-of-range
integers, caps on stop and n x work, deep JSON, huge and slow headers, HTTP/1.0 streams, overload.
Every answer is a 4xx/5xx in the OpenAI error schema, never a hang or a 500, and the server goes on."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx
import pytest

from tests.procs.test_api_errors import assert_error
from tests.launch import Server

MAX_REQUESTS = 4
CONFIG = {"max_requests": MAX_REQUESTS, "header_timeout_s": 2.0, "max_job_tokens": 2048, "max_header_bytes": 16384}


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    s = Server(tiny_qwen3, tmp_path_factory.mktemp("hostile"), config=CONFIG, max_model_len=1024)
    yield s
    s.stop()


def post(server, body, timeout=20.0, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2, **body},
                      timeout=timeout, **kw)


def still_serves(server) -> None:
    r = post(server, {"max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_seed_outside_int64_is_400_not_a_hang(server, seed):
    """Before: msgspec took any JSON integer, the PrefillReq could not be encoded, the request hung."""
    assert_error(post(server, {"seed": seed}), 400, param="seed")
    still_serves(server)


def test_seed_plus_n_must_stay_in_int64(server):
    assert_error(post(server, {"seed": 2**63 - 1, "n": 2}), 400, param="seed")
    assert post(server, {"seed": 2**63 - 1}).status_code == 200
    assert post(server, {"seed": -2**63}).status_code == 200


def test_min_tokens_bounded_by_max_tokens_and_the_context(server):
    assert_error(post(server, {"min_tokens": 10**18, "max_tokens": None}), 400, param="min_tokens")
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", timeout=20,
                            json={"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5000}),
                 400, param="min_tokens")
    assert_error(post(server, {"min_tokens": 5, "max_tokens": 4}), 400, param="min_tokens")


def test_stop_count_and_length_are_capped(server):
    assert_error(post(server, {"stop": [f"s{i}" for i in range(5)]}), 400, param="stop")
    assert_error(post(server, {"stop": ["x" * 2000]}), 400, param="stop")
    assert post(server, {"stop": ["a", "b", "c", "d"]}).status_code == 200


def test_n_times_work_is_capped(server):
    assert_error(post(server, {"n": 4, "max_tokens": 600}), 400, param="n")
    assert post(server, {"n": 2, "max_tokens": 4}).status_code == 200


def test_deep_json_is_400(server):
    body = b'{"prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=20,
                   headers={"content-type": "application/json"})
    assert_error(r, 400)
    still_serves(server)


def test_huge_header_is_431(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"x-pad": "a" * 65536}, timeout=20)
    assert_error(r, 431)
    still_serves(server)


def test_slow_headers_are_cut_off(server):
    """200 connections each sending a header byte every half second are closed after header_timeout_s."""
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    closed = set()
    while len(closed) < len(socks) and time.monotonic() - t0 < 15:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"x")
                s.settimeout(0.001)
                if s.recv(4096) == b"":
                    closed.add(i)
            except socket.timeout:
                pass
            except OSError:
                closed.add(i)
        time.sleep(0.5)
    for s in socks:
        s.close()
    assert len(closed) == len(socks)
    still_serves(server)


def test_http10_stream_is_not_chunked(server):
    body = b'{"prompt": "hello", "max_tokens": 4, "stream": true}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):  # the server closes: that ends the body
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert rest.startswith(b"data: ") and rest.endswith(b"data: [DONE]\n\n")


def test_over_the_limit_is_503_before_the_200(server):
    """Every streamed request over max_requests is a 503 with Retry-After; none starts a 200 and then fails."""
    def one(_):
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "hello " * 20, "max_tokens": 24, "stream": True, "ignore_eos": True}) as r:
            text = "".join(r.iter_text())
            return r.status_code, r.headers.get("retry-after"), text

    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(32)))
    assert {s for s, _, _ in results} <= {200, 503}
    assert any(s == 200 for s, _, _ in results) and any(s == 503 for s, _, _ in results)
    for status, retry, text in results:
        if status == 200:
            assert '"error"' not in text and text.endswith("data: [DONE]\n\n")
        else:
            assert retry is not None
    still_serves(server)


@pytest.mark.parametrize("key", ["²", "①", "٣", "-1", "1.5", "", "1" * 25])
def test_logit_bias_keys_are_ascii_token_ids(server, key):
    """Before: "²" and "①" (str.isdigit, but no int) were a 500."""
    assert_error(post(server, {"logit_bias": {key: 1}}), 400, param="logit_bias")
    still_serves(server)


@pytest.mark.parametrize("tid", [32000, 10**9, 2**63, 10**30])
def test_token_ids_past_the_vocabulary_are_400(server, tid):
    """Before: logit_bias past the vocabulary was a 200 with the bias dropped (OpenAI and vLLM answer 400), and
    on a prompt handed to the prefill server a huge id was a 503 (the handoff could not be encoded)."""
    r = post(server, {"logit_bias": {str(tid): 5}})  # checked before any handoff
    assert_error(r, 400, param="logit_bias")
    assert "vocabulary" in r.json()["error"]["message"] or "token ids" in r.json()["error"]["message"]
    if tid < 2**63:
        assert_error(post(server, {"stop_token_ids": [tid]}), 400, param="stop_token_ids")
    assert post(server, {"logit_bias": {"5": 5}, "stop_token_ids": [7]}).status_code == 200


def test_logit_bias_and_stop_token_ids_sizes_are_capped(server):
    """Before: a 280k-entry logit_bias or 400k stop_token_ids (under the body limit) was accepted and slowed every
    other stream 3-7x per token. The caps are max_logit_bias and max_stop_token_ids (docs/API.md)."""
    r = post(server, {"logit_bias": {str(i): 1 for i in range(301)}})
    assert_error(r, 400, param="logit_bias")
    assert "max_logit_bias" in r.json()["error"]["message"] and "300" in r.json()["error"]["message"]
    r = post(server, {"stop_token_ids": list(range(129))})
    assert_error(r, 400, param="stop_token_ids")
    assert "max_stop_token_ids" in r.json()["error"]["message"]
    assert post(server, {"logit_bias": {str(i): 1 for i in range(300)}, "stop_token_ids": list(range(128))}
                ).status_code == 200
    assert_error(post(server, {"stop_token_ids": [-1]}), 400, param="stop_token_ids")


def test_admin_requests_finds_every_choice_of_an_n_2_request(server):
    """Before: /admin/requests/<id> 404'd for the id the client saw in an n=2 reply (its choices run as <id>-0,
    <id>-1)."""
    r = post(server, {"n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    got = httpx.get(f"{server.url}/admin/requests/{rid}", timeout=20)
    assert got.status_code == 200, got.text
    assert sorted(t["id"] for t in got.json()["traces"]) == [f"{rid}-0", f"{rid}-1"]
    assert httpx.get(f"{server.url}/admin/requests/{rid}-1", timeout=20).json()["traces"][0]["id"] == f"{rid}-1"
    assert httpx.get(f"{server.url}/admin/requests/{rid[:-1]}", timeout=20).status_code == 404


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def chat(server, body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})


def test_grammar_limits_are_400s_naming_the_field_and_the_limit(server):
    """Before: a json_schema or tool schema nested 300-400 deep was a 500; a 2.3 MB grammar a 500 after 33-49 s
    (/health 15-22 s meanwhile); the regex (a{1000}){1000} a 200 with text that did not match it."""
    deep = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(300)}}
    r = chat(server, {"response_format": deep})
    assert_error(r, 400, param="response_format.json_schema.schema")
    assert "max_grammar_depth" in r.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(400)}}
    r = chat(server, {"tools": [tool], "tool_choice": "required"})
    assert_error(r, 400, param="tools[0].function.parameters")
    r = post(server, {"structured_outputs": {"regex": "a" * 300_000}})
    assert_error(r, 400, param="structured_outputs.regex")
    assert "max_grammar_chars" in r.json()["error"]["message"] and "262144" in r.json()["error"]["message"]
    r = post(server, {"structured_outputs": {"regex": "(a{1000}){1000}"}})
    assert_error(r, 400, param="structured_outputs.regex")
    assert "more than the grammar engine can enforce" in r.json()["error"]["message"]
    ok = chat(server, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(5)}}})
    assert ok.status_code == 200, ok.text
    assert post(server, {"structured_outputs": {"regex": "[0-9]{3}"}, "max_tokens": 4}).status_code == 200
    still_serves(server)


def test_long_session_ids_are_kept_as_their_hash(server):
    """Before: every request's session id was kept as sent, in the decode and the prefill server's rings of
    recent traces (512 each): 600 distinct 1 MB ids grew a server by 515 MB (RSS from /proc). An id over 128
    characters is kept as its 32-character hash (the router's, so it is one session either way); a short one as
    sent."""
    from tests.launch import children
    from tests.procs.test_faults import rss_mb
    from trnd.http.session import session_key

    def rss() -> float:  # the deployment's: trnd serve and its roles (decode, prefill)
        return sum(rss_mb(p) for p in {server.proc.pid} | children(server.proc.pid))

    def session_of_reply(r: httpx.Response) -> str:
        assert r.status_code == 200, r.text[:300]
        trace = httpx.get(f"{server.url}/admin/requests/{r.json()['id']}", timeout=20).json()["traces"][0]
        return trace["session_id"]

    assert session_of_reply(post(server, {"session_id": "chat-42"})) == "chat-42"
    base = rss()
    with httpx.Client(timeout=60) as c:
        for i in range(256):
            body = {"prompt": "hello", "max_tokens": 1, ("session_id", "prompt_cache_key", "user")[i % 3]:
                    f"{i:04d}" + "x" * 2**20}
            r = c.post(f"{server.url}/v1/completions", json=body)
    grew = rss() - base
    assert grew < 64, f"{grew:.0f} MB for 256 ids of 1 MB"  # kept as sent they were 256 MB
    assert session_of_reply(r) == session_key("0255" + "x" * 2**20)
