"""Tool calls, structured outputs and reasoning with the official openai client against `trnd serve`
(prefill + decode roles) and `trnd serve --aggregated`, on the default `small` model (random weights:
every valid output below is the grammar's doing)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from trnd.model.maker import ensure_model

from tests.system.test_api_openai import Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module", params=["disaggregated", "aggregated"])
def server(request, tmp_path_factory):
    args = ("--kv-memory-gb", "0.3", *(("--aggregated",) if request.param == "aggregated" else ()))
    s = Server(ensure_model("small"), tmp_path_factory.mktemp(request.param), *args, max_model_len=2048)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client(timeout=120) as c:
        yield c


def _check_calls(calls, names):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _warm(client, model, **kw) -> None:
    """Put the prompt's pages in the prefix cache first. Replies compared token for token must see the
    same cache state: a cold prefill and a cached one (only the tail computed) round differently in
    bf16 with the compiled CPU kernels, and the random model's logits have near-ties that this flips."""
    client.chat.completions.create(model=model, max_tokens=1, **kw)


def _stream_calls(stream):
    calls, finish, content = {}, None, ""
    for ev in stream:
        if not ev.choices:
            continue
        ch = ev.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    return list(calls.values()), finish, content


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_forced_tool_calls_validate(client, choice, names):
    m = client.models.list().data[0].id
    _warm(client, m, messages=ASK, tools=TOOLS, tool_choice=choice)
    r = client.chat.completions.create(model=m, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300,
                                       temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    _check_calls(ch.message.tool_calls, names)
    calls, finish, content = _stream_calls(client.chat.completions.create(
        model=m, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=0, stream=True))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                             for c in ch.message.tool_calls]
    # seeded, random sampling: still valid
    r = client.chat.completions.create(model=m, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=300,
                                       seed=11, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls, names)


def test_tool_result_conversation_and_auto(client):
    m = client.models.list().data[0].id
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=m, messages=msgs, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=m, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None


def test_json_schema_and_json_object(client):
    m = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=m, messages=ASK, max_tokens=300, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    text = "".join(ev.choices[0].delta.content or "" for ev in client.chat.completions.create(
        model=m, messages=ASK, max_tokens=300, temperature=0, response_format=fmt, stream=True) if ev.choices)
    assert text == r.choices[0].message.content
    # Any object: the random model's strings could run on for thousands of tokens, so nudge it towards
    # closing them (tokens '"', '"}' and '}'); the mask alone makes it valid JSON.
    r = client.chat.completions.create(model=m, messages=ASK, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"},
                                       logit_bias={"4": 15, "882": 15, "95": 10})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=m, messages=ASK, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=m, prompt="Code:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}})
    assert __import__("re").fullmatch("[A-Z]{3}-[0-9]{4}", r.choices[0].text)


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs.regex"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"some_future_field": 1}}, "some_future_field"),
    ({"extra_body": {"no_stop_trim": True}}, "no_stop_trim"),
    ({"extra_body": {"include_reasoning": False}}, "include_reasoning"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"json_object": True}}},
     "structured_outputs"),
])
def test_bad_requests_are_400_naming_the_field(client, kw, param):
    m = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=m, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_completions_echo_suffix_and_extras(client, server):
    m = client.models.list().data[0].id
    for kw, param in (({"echo": True, "logprobs": 1}, "echo"), ({"suffix": "x"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=m, prompt="hi", max_tokens=2, **kw)
        assert e.value.body["param"] == param
    r = client.chat.completions.create(model=m, messages=ASK, max_completion_tokens=3, temperature=0, user="u-1",
                                       logit_bias={"7": 100}, extra_body={"session_id": "sess-9"})
    assert r.usage.completion_tokens == 3 and r.choices[0].message.content
    # what an SGLang-style router (vllm-router) adds to every body: its defaults are what trnd does
    sglang = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
              "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
              "include_reasoning": True}
    r = client.chat.completions.create(model=m, messages=ASK, max_tokens=2, extra_body=sglang)
    assert r.usage.completion_tokens == 2
    assert client.models.list().data[0].model_extra["max_model_len"] == 2048


def test_disaggregated_equals_aggregated_under_a_schema(server, client, tmp_path_factory):
    """Prefill samples token 0 under the grammar, decode continues: greedy and seeded replies match the
    aggregated server's exactly (run once, from the disaggregated module instance)."""
    if "--aggregated" in server.proc.args:
        pytest.skip("compared from the disaggregated instance")
    other = Server(ensure_model("small"), tmp_path_factory.mktemp("agg-compare"), "--aggregated", "--kv-memory-gb", "0.15",
                   max_model_len=2048)
    try:
        with other.client(timeout=120) as c2:
            m = client.models.list().data[0].id
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
            for c in (client, c2):  # both caches in the same state (see _warm)
                _warm(c, m, messages=ASK, response_format=fmt)
                _warm(c, m, messages=ASK, tools=TOOLS, tool_choice="required")
            for kw in ({"temperature": 0}, {"seed": 5, "temperature": 1.0}):
                a, b = (c.chat.completions.create(model=m, messages=ASK, max_tokens=200, response_format=fmt, **kw)
                        for c in (client, c2))
                assert a.choices[0].message.content == b.choices[0].message.content
                jsonschema.validate(json.loads(a.choices[0].message.content), PERSON)
                a, b = (c.chat.completions.create(model=m, messages=ASK, max_tokens=200, tools=TOOLS,
                                                  tool_choice="required", **kw) for c in (client, c2))
                assert ([(t.function.name, t.function.arguments) for t in a.choices[0].message.tool_calls]
                        == [(t.function.name, t.function.arguments) for t in b.choices[0].message.tool_calls])
    finally:
        other.stop()


def test_reasoning_parser_and_template_kwargs(tiny_qwen3, tmp_path):
    """With a reasoning parser, enable_thinking=false closes the think block in the prompt, so the
    grammar applies from the first token and the reply is all content."""
    s = Server(tiny_qwen3, tmp_path, "--aggregated", "--reasoning-parser", "qwen3")
    try:
        with s.client() as c:
            m = c.models.list().data[0].id
            r = c.chat.completions.create(model=m, messages=ASK, max_tokens=200, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": PERSON}},
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
            assert r.choices[0].message.model_extra.get("reasoning_content") is None
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model=m, messages=ASK, max_tokens=2,
                                          extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
            assert e.value.body["param"] == "chat_template_kwargs.add_generation_prompt"
    finally:
        s.stop()


class _NoLlguidance:
    """An engine whose llguidance side cannot be made (as on a host without the package)."""

    touched = 0

    @property
    def grammars(self):
        self.touched += 1
        raise ModuleNotFoundError("No module named 'llguidance'")


def test_a_request_without_a_grammar_never_touches_llguidance():
    """Found on the GPU host, whose image lacked llguidance: every plain request failed with 500, since the
    server evaluated engine.grammars (made on first use) before knowing whether the request had a grammar."""
    import msgspec

    from trnd.api import protocol as P
    from trnd.api.chat import ChatPlan, chat_grammar
    from trnd.api.structured import request_grammar

    engine = _NoLlguidance()
    plain = msgspec.convert({"model": "m", "prompt": "hi"}, P.CompletionRequest)
    assert request_grammar(plain, engine) is None
    chat = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, P.ChatCompletionRequest)
    assert chat_grammar(chat, ChatPlan(), "hi", engine) is None
    assert engine.touched == 0
    shaped = msgspec.convert({"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}},
                             P.CompletionRequest)
    with pytest.raises(ModuleNotFoundError):
        request_grammar(shaped, engine)
    assert engine.touched == 1
