"""The OpenAI-compatible API against a real `trnd serve` process, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.launch import MAX_MODEL_LEN, Server, wait_for


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    s = Server(tiny_qwen3, tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


# -- models, probes ---------------------------------------------------------------------------------

def test_models_lists_the_served_model(client, tiny_qwen3):
    models = client.models.list().data
    assert [m.id for m in models] == [Path(tiny_qwen3).name]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    from trnd.model.maker import param_count

    cfg = json.loads((Path(tiny_qwen3) / "config.json").read_text())
    size = models[0].model_extra["parameters"]  # trnd/model/size.py: a dense model's are all active
    assert size["total_params"] == size["active_params"] == param_count(cfg) and size["weight_bytes"] > 0


def test_health_and_ready(server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.get(f"{server.url}/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


# -- chat -------------------------------------------------------------------------------------------

def test_chat_max_tokens_gives_length_and_usage(client, model):
    r = client.chat.completions.create(model=model, messages=chat("Hello there"), max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length"
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    u = r.usage
    assert u.completion_tokens == 7 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # max_completion_tokens is the newer name for the same limit
    r2 = client.chat.completions.create(model=model, messages=chat("Hello there"), max_completion_tokens=3,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 3 and r2.choices[0].finish_reason == "length"


def test_chat_prompt_is_cached_the_second_time(client, model):
    msgs = chat("a prompt long enough to fill a few pages of the prefix cache " * 4)
    client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_content_parts_equal_plain_string(client, model):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    a = client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=8,
                                       temperature=0)
    b = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client, model):
    kw = dict(model=model, messages=chat("Tell me about caches"), max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_ends_with_done(server, model):
    body = {"model": model, "messages": chat("hi"), "max_tokens": 3, "stream": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_stop_string_truncates(client, model):
    kw = dict(model=model, messages=chat("Write something"), max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**kw).choices[0].message.content
    assert len(text) >= 6
    stop = text[3:5]
    r = client.chat.completions.create(**kw, stop=[stop, "\x00never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]
    # the same through a stream, and a single string as stop
    streamed = client.chat.completions.create(**kw, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == text[:text.index(stop)]


def test_seed_reproducible_at_temperature_one(client, model):
    def run(seed):
        r = client.chat.completions.create(model=model, messages=chat("Pick words"), max_tokens=16,
                                           temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].message.content
    a = run(1234)
    assert run(1234) == a
    assert any(run(s) != a for s in (1, 2, 3))


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=chat("Count"), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert t.logprob <= 0 and isinstance(t.token, str)
        assert bytes(t.bytes).decode(errors="replace") == t.token  # raw bytes, even of a partial character
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy picks the most likely token, so it heads the list
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    r = client.chat.completions.create(model=model, messages=chat("Count"), max_tokens=3, logprobs=True)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=model, messages=chat("Count"), max_tokens=3)
    assert r.choices[0].logprobs is None


def test_chat_n_choices(client, model):
    kw = dict(model=model, messages=chat("Many answers"), max_tokens=8, temperature=1.0, seed=5, n=3,
              extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seeds 5, 6, 7
    streamed = ["", "", ""]
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    # choice i of n with seed s is the single request with seed s + i
    one = client.chat.completions.create(**{**kw, "n": 1, "seed": 7})
    assert one.choices[0].message.content == texts[2]


def test_ignore_eos_and_min_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=chat("x"), max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=model, messages=chat("x"), max_tokens=10, temperature=0,
                                       extra_body={"min_tokens": 10})
    assert r.usage.completion_tokens == 10


def test_unknown_fields_are_400_known_extras_accepted(client, model):
    r = client.chat.completions.create(model=model, messages=chat("x"), max_tokens=2, user="someone",
                                       extra_body={"session_id": "s-1"})
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=chat("x"), max_tokens=2,
                                       extra_body={"some_future_field": {"a": [1]}})
    assert e.value.body["param"] == "some_future_field"


# -- completions ------------------------------------------------------------------------------------

def test_completions_prompt_forms(client, model, tiny_qwen3):
    from trnd.model.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(str(tiny_qwen3)).encode("The cache holds pages")
    kw = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    a = client.completions.create(prompt="The cache holds pages", **kw)
    b = client.completions.create(prompt=ids, **kw)
    c = client.completions.create(prompt=["The cache holds pages"], **kw)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)
    assert a.usage.completion_tokens == 6 and a.choices[0].finish_reason == "length"


def test_completions_default_max_tokens_is_16(client, model):
    r = client.completions.create(model=model, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completions_stream_and_usage(client, model):
    kw = dict(model=model, prompt="Once upon", max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and value <= 0
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is the top one
    # streamed logprobs carry on the offsets
    offsets = []
    for ch in client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0, logprobs=2,
                                        stream=True, extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].logprobs:
            offsets += ch.choices[0].logprobs.text_offset
    assert offsets == lp.text_offset


def test_completions_n_and_seed(client, model):
    kw = dict(model=model, prompt="Numbers:", max_tokens=6, temperature=1.0, seed=11, n=2,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1]


# -- async client -----------------------------------------------------------------------------------

def test_async_client_stream_and_not(server, model):
    async def main():
        async with server.async_client() as ac:
            r = await ac.chat.completions.create(model=model, messages=chat("async"), max_tokens=5, temperature=0)
            text = ""
            async for ch in await ac.chat.completions.create(model=model, messages=chat("async"), max_tokens=5,
                                                             temperature=0, stream=True):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
            c = await ac.completions.create(model=model, prompt="async", max_tokens=4, temperature=0)
            ctext = ""
            async for ch in await ac.completions.create(model=model, prompt="async", max_tokens=4, temperature=0,
                                                        stream=True):
                ctext += ch.choices[0].text if ch.choices else ""
            return r.choices[0].message.content, text, c.choices[0].text, ctext

    a, b, c, d = asyncio.run(main())
    assert a == b and c == d


# -- admin and metrics ------------------------------------------------------------------------------

def test_admin_state_schema(server, tiny_qwen3):
    s = server.state()
    assert s["model"] == Path(tiny_qwen3).name and s["role"] in ("serve", "decode") and s["draining"] is False
    assert s["uptime_s"] > 0
    for key in ("running", "waiting", "pages", "radix", "stats", "limits"):
        assert key in s
    assert s["limits"]["max_model_len"] == MAX_MODEL_LEN
    assert {"total", "free", "in_use", "cached", "page_size"} <= set(s["pages"])


def test_the_page_pool_check_runs_when_idle_and_shows_in_admin_state_and_top(server, client, model):
    from trnd import snapshot
    from trnd.top.cli import render_plain
    from trnd.top.model import NodeTrack, Poll

    client.chat.completions.create(model=model, messages=chat("count"), max_tokens=3, temperature=0)
    done = time.time()  # idle from now: checked within IDLE_CHECK_S, or CHECK_EVERY_S after the last check
    s = wait_for(lambda: (st := server.state()).get("integrity") and st["integrity"]["at"] > done and st, 30)
    assert s["integrity"]["ok"] is True and s["integrity"]["error"] is None
    p = s["integrity"]["pages"]
    assert p["free"] + p["cached"] + p["in_use"] == p["total"] == s["pages"]["total"]
    t = NodeTrack("n")
    t.update(Poll(snapshot.decode(s), ready="ready"), 0.0)
    assert t.status == "ready" and "page pool check ok" in render_plain([t])


def test_a_session_given_as_the_routers_header_is_the_requests_session(server, client, model):
    """x-session-id (what `trnd router` forwards, and what its clients may send) names the session when the body
    has none; a body session_id still wins."""
    for extra, want in (({}, "hdr-1"), ({"session_id": "body-1"}, "body-1")):
        stream = client.completions.create(model=model, prompt="go on", max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, **extra},
                                           extra_headers={"x-session-id": "hdr-1"})
        it = iter(stream)
        first = next(it)
        running = server.state()["running"]
        assert [(r["id"], r["session_id"]) for r in running] == [(first.id, want)]
        assert httpx.post(f"{server.url}/admin/abort/{first.id}").status_code == 200
        list(it)


def test_admin_abort_stops_a_stream(server, client, model):
    stream = client.chat.completions.create(model=model, messages=chat("go on"), max_tokens=400, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True, "session_id": "sess-9"})
    it = iter(stream)
    first = next(it)  # the role chunk, sent before the engine has the request
    next(it)  # a generated token: the request is running now
    running = server.state()["running"]
    assert [(r["id"], r["session_id"]) for r in running] == [(first.id, "sess-9")]
    r = httpx.post(f"{server.url}/admin/abort/{first.id}")
    assert r.status_code == 200 and r.json() == {"aborted": [first.id]}
    rest = list(it)
    assert rest[-1].choices[0].finish_reason == "abort"
    assert len(rest) < 399
    server.wait_idle()
    r = httpx.post(f"{server.url}/admin/abort/{first.id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"


def test_admin_evict_frees_cached_pages(server, client, model):
    client.completions.create(model=model, prompt="evict me " * 20, max_tokens=2)
    before = server.wait_idle()
    assert before["radix"]["cached_pages"] > 0
    r = httpx.post(f"{server.url}/admin/evict")
    assert r.status_code == 200 and r.json()["evicted_pages"] == before["radix"]["cached_pages"]
    after = server.state()
    assert after["radix"]["cached_pages"] == 0 and after["pages"]["free"] == after["pages"]["total"]


def test_metrics(server, client, model):
    client.chat.completions.create(model=model, messages=chat("metrics"), max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == model
            values[(sample.name, *sorted(labels.values()))] = sample.value
    assert values[("trnd:generation_tokens_total",)] >= 4
    assert values[("trnd:prompt_tokens_total",)] > 0
    assert values[("trnd:request_success_total", "length")] >= 1
    assert ("trnd:request_success_total", "abort") in values
    assert values[("trnd:time_to_first_token_seconds_count",)] >= 1
    assert values[("trnd:inter_token_latency_seconds_count",)] >= 3
    assert values[("trnd:e2e_request_latency_seconds_count",)] >= 1
    assert values[("trnd:num_requests_running",)] == 0
    assert values[("trnd:num_requests_waiting",)] == 0
    assert 0 <= values[("trnd:kv_cache_usage_perc",)] <= 1
    assert values[("trnd:prefix_cache_queries_total",)] >= values[("trnd:prefix_cache_hits_total",)] >= 0
