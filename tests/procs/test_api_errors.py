"""Bad input gets a 4xx in OpenAI's error schema naming the field, never a 5xx; auth, limits, draining."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.checks import assert_error
from tests.launch import Server

MAX_MODEL_LEN = 4096  # long enough that a few requests stay in flight while the test looks
MAX_BODY = 128 * 1024
MAX_REQUESTS = 4
MAX_N = 4


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    s = Server(tiny_qwen3, tmp_path_factory.mktemp("serve-err"),
               config={"max_body_bytes": MAX_BODY, "max_requests": MAX_REQUESTS, "max_n": MAX_N},
               max_model_len=MAX_MODEL_LEN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, timeout=30, **kw)
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kw)


def chat_body(model, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


# -- shape and JSON ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"messages": NaN}', b"\xff\xfe", b'{"model": "m", "messages":'])
def test_invalid_json_is_400(server, raw):
    assert_error(post(server, "/v1/chat/completions", raw), 400, param=None, code="invalid_json")


@pytest.mark.parametrize("patch, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
    ({"n": "2"}, "n"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 1e999}, "temperature"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 3]}, "stop[1]"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"logprobs": 1}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids[1]"),
    ({"session_id": 7}, "session_id"),
])
def test_wrong_types_name_the_field(server, model, patch, param):
    raw = json.dumps(chat_body(model, **patch)).replace("Infinity", "1e999")
    assert_error(post(server, "/v1/chat/completions", raw), 400, param=param, code="invalid_value")


def test_missing_and_non_object(server, model):
    assert_error(post(server, "/v1/chat/completions", {"model": model}), 400, param="messages")
    assert_error(post(server, "/v1/completions", {"model": model}), 400, param="prompt")
    assert_error(post(server, "/v1/chat/completions", []), 400, param=None)
    assert_error(post(server, "/v1/chat/completions", "3"), 400, param=None)


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "function", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
])
def test_bad_messages(server, model, messages, param):
    assert_error(post(server, "/v1/chat/completions", chat_body(model, messages=messages)), 400, param=param)


def test_unknown_model_is_404(server):
    err = assert_error(post(server, "/v1/chat/completions", chat_body("gpt-17")), 404, param="model",
                       code="model_not_found")
    assert "gpt-17" in err["message"]
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404, code="model_not_found")


# -- sampling ranges --------------------------------------------------------------------------------

@pytest.mark.parametrize("param, value", [
    ("temperature", -0.1), ("temperature", 2.01), ("top_p", 0), ("top_p", 1.5), ("top_p", -1), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.5), ("n", 0), ("n", MAX_N + 1), ("max_tokens", 0), ("max_tokens", -5),
    ("max_completion_tokens", 0), ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("min_tokens", -1), ("min_tokens", 4), ("temperature", 1e308), ("top_logprobs", 21), ("top_logprobs", -1),
])
def test_chat_out_of_range_names_the_param(server, model, param, value):
    body = chat_body(model, **{param: value})
    if param == "top_logprobs":
        body["logprobs"] = True
    err = assert_error(post(server, "/v1/chat/completions", body), 400, param=param)
    assert param in err["message"]


def test_top_logprobs_needs_logprobs(server, model):
    assert_error(post(server, "/v1/chat/completions", chat_body(model, top_logprobs=2)), 400, param="top_logprobs")


@pytest.mark.parametrize("patch, param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"echo": True, "logprobs": 1}, "echo"),
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, 10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": ["a", ""]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": [[1], [10**9]]}, "prompt"),
    ({"best_of": 3}, "best_of"), ({"temperature": -1}, "temperature"),
])
def test_completions_bad_values(server, model, patch, param):
    body = {"model": model, "prompt": "hello", "max_tokens": 2, **patch}
    assert_error(post(server, "/v1/completions", body), 400, param=param)


def test_context_length_exceeded(server, model):
    err = assert_error(post(server, "/v1/completions", {"model": model, "prompt": [5] * (MAX_MODEL_LEN + 10)}),
                       400, param="prompt", code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN + 10) in err["message"]
    long_chat = [{"role": "user", "content": "token " * (MAX_MODEL_LEN + 10)}]
    assert_error(post(server, "/v1/chat/completions", chat_body(model, messages=long_chat)), 400,
                 param="messages", code="context_length_exceeded")
    err = assert_error(post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}),
                       400, param="max_tokens", code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in err["message"]
    assert_error(post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 10**30}), 400,
                 param="max_tokens", code="context_length_exceeded")
    # the openai client surfaces it as BadRequestError with the code
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=model, prompt=[5] * (MAX_MODEL_LEN + 1))
        assert e.value.code == "context_length_exceeded"


# -- size, routing ----------------------------------------------------------------------------------

def test_body_too_large(server, model):
    big = json.dumps(chat_body(model, messages=[{"role": "user", "content": "x" * MAX_BODY}])).encode()
    assert_error(post(server, "/v1/chat/completions", big), 413)

    def chunked():  # no Content-Length: the limit must hold on the bytes actually received
        yield big[:1000]
        yield big[1000:]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=chunked(), timeout=30)
    assert "content-length" not in r.request.headers
    assert_error(r, 413)
    assert_error(post(server, "/v1/completions", big), 413)


def test_wrong_method_and_path(server):
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]
    assert_error(httpx.post(f"{server.url}/v1/models"), 405)
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/"), 404)


# -- overload ---------------------------------------------------------------------------------------

def test_queue_full_is_503_with_retry_after(server, model):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            body = chat_body(model, max_tokens=MAX_MODEL_LEN - 100, stream=True, ignore_eos=True)
            streams, readers = [], []  # keep the readers: a collected one closes its connection
            try:
                for _ in range(MAX_REQUESTS):
                    cm = c.stream("POST", "/v1/chat/completions", json=body)
                    r = await cm.__aenter__()
                    streams.append(cm)
                    lines = r.aiter_lines()
                    readers.append(lines)
                    seen = 0
                    while seen < 2:  # role chunk, then a generated token: the request is in flight
                        if (await lines.__anext__()).startswith("data: "):
                            seen += 1
                full = await c.post("/v1/chat/completions", json=chat_body(model))
                n_too_many = await c.post("/v1/completions", json={"model": model, "prompt": "x", "n": 2})
                return full, n_too_many
            finally:
                for cm in streams:
                    await cm.__aexit__(None, None, None)

    full, n_too_many = asyncio.run(main())
    assert_error(full, 503, code="overloaded")
    assert full.headers["retry-after"] == "1"
    assert_error(n_too_many, 503, code="overloaded")
    server.wait_idle(10)
    r = post(server, "/v1/chat/completions", chat_body(model))
    assert r.status_code == 200, r.text


# -- fuzz -------------------------------------------------------------------------------------------

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stream", "stream_options", "session_id", "ignore_eos", "min_tokens",
          "skip_special_tokens", "stop_token_ids", "echo", "best_of", "user", "tools", "tool_choice",
          "response_format", "structured_outputs", "logit_bias", "chat_template_kwargs", "parallel_tool_calls",
          "suffix", "guided_json", "no_stop_trim", "include_reasoning", "include_stop_str_in_output",
          "truncate_prompt_tokens", "truncation_side", "add_special_tokens", "add_generation_prompt",
          "continue_final_message", "chat_template", "documents", "priority", "request_id",
          "return_tokens_as_token_ids", "use_beam_search", "bad_words", "reasoning_effort"]

scalars = (st.none() | st.booleans() | st.integers(-3, 30) | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3) | st.text(max_size=12))
junk = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
plausible = (st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 3]),
                                             "content": st.text(max_size=20) | junk}), max_size=3)
             | st.lists(st.integers(-5, 2000), max_size=6))


def _cap(body: dict) -> dict:
    """Keep valid requests short: the fuzz hunts for 5xx, not for long generations."""
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and 6 < v < 10**6:
            body[k] = 6
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    if isinstance(body.get("min_tokens"), int) and 6 < body["min_tokens"] < 10**6:
        body["min_tokens"] = 6
    return body


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
       fields=st.dictionaries(st.sampled_from(FIELDS), junk | plausible, max_size=6))
def test_fuzz_no_5xx(server, model, endpoint, fields):
    base = ({"model": model, "messages": [{"role": "user", "content": "hi"}]} if "chat" in endpoint
            else {"model": model, "prompt": "hi"})
    body = _cap({**base, **fields})
    r = post(server, endpoint, json.dumps(body, allow_nan=True))
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert_error(r, r.status_code)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.binary(max_size=64))
def test_fuzz_raw_bytes(server, raw):
    r = post(server, "/v1/completions", raw)
    assert_error(r, 400)


def test_server_healthy_after_fuzz(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle(10)


# -- API key ----------------------------------------------------------------------------------------

KEY = "sekrit-key-123"


@pytest.fixture(scope="module")
def auth_server(tiny_qwen3, tmp_path_factory):
    s = Server(tiny_qwen3, tmp_path_factory.mktemp("serve-auth"), api_key=KEY)
    yield s
    s.stop()


def test_api_key_required_on_v1_and_admin(auth_server):
    url = auth_server.url
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("GET", "/admin/state"), ("POST", "/admin/drain"), ("POST", "/admin/evict"),
                         ("POST", "/admin/abort/x"), ("GET", "/nope"), ("GET", "/health/"),
                         ("GET", "/metrics/x"), ("GET", "/v1/../admin/state")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer  {KEY}"}):
            r = httpx.request(method, f"{url}{path}", headers=headers, json={})
            assert_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/ready").json()["status"] == "ready"  # drain above was refused


def test_probes_open_without_key(auth_server):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{auth_server.url}{path}").status_code == 200


def test_api_key_accepted(auth_server):
    h = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{auth_server.url}/v1/models", headers=h).status_code == 200
    assert httpx.get(f"{auth_server.url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{auth_server.url}/admin/state", headers=h).status_code == 200
    assert_error(httpx.get(f"{auth_server.url}/nope", headers=h), 404)
    with openai.OpenAI(base_url=f"{auth_server.url}/v1", api_key=KEY, max_retries=0) as c:
        model = c.models.list().data[0].id
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=f"{auth_server.url}/v1", api_key="bad", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()


