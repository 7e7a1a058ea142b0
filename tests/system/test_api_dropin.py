"""What a vLLM or SGLang user sends, against a real `trnd serve` (a prefill and a decode process) through
the official openai client and plain HTTP: vLLM's and SGLang's request extras at their defaults and
beyond, batched prompts, the tokenizer routes, /version, /v1/models/{id}, OpenAI's error types, and the
Responses API (text, streaming events, tools, reasoning, previous_response_id, store)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tests.launch import Server
from trnd.api.fields import AT_DEFAULT

# Every extra field of vLLM's ChatCompletionRequest / CompletionRequest at its default, as a client built
# for vLLM sends them (vllm/entrypoints/openai/{chat_completion,completion}/protocol.py).
VLLM_COMMON = {
    "use_beam_search": False, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "watermarking": None,
    "length_penalty": 1.0, "stop_token_ids": [], "include_stop_str_in_output": False, "ignore_eos": False,
    "min_tokens": 0, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None, "truncation_side": None, "prompt_logprobs": None, "logprob_token_ids": None,
    "allowed_token_ids": None, "bad_words": [], "structured_outputs": None, "priority": 0, "request_id": None,
    "session_id": None, "return_tokens_as_token_ids": None, "return_token_ids": None,
    "routed_experts_prompt_start": 0, "return_token_offsets": False, "return_mm_kwargs": True,
    "kv_transfer_params": None, "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None,
    "stream_interval": None, "thinking_token_budget": None, "echo": False}
VLLM_CHAT = {**VLLM_COMMON, "add_generation_prompt": True, "continue_final_message": False,
             "add_special_tokens": False, "documents": None, "chat_template": None, "chat_template_kwargs": None,
             "media_io_kwargs": None, "mm_processor_kwargs": None, "return_prompt_text": None,
             "include_reasoning": True, "reasoning_effort": None, "parallel_tool_calls": True}
VLLM_COMPLETION = {**VLLM_COMMON, "add_special_tokens": True, "prompt_embeds": None, "response_format": None}
# SGLang's extras at their defaults (python/sglang/srt/entrypoints/openai/protocol.py)
SGLANG = {"top_k": -1, "min_p": 0.0, "min_tokens": 0, "regex": None, "ebnf": None, "repetition_penalty": 1.0,
          "stop_token_ids": None, "stop_regex": None, "no_stop_trim": False, "ignore_eos": False,
          "skip_special_tokens": True, "lora_path": None, "session_params": None, "return_hidden_states": False,
          "return_routed_experts": False, "routed_experts_start_len": 0, "return_cached_tokens_details": False,
          "custom_params": None, "custom_logit_processor": None, "rid": None, "extra_key": None,
          "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "routed_dp_rank": None,
          "data_parallel_rank": None, "priority": None, "custom_labels": None, "return_token_ids": False}
SGLANG_CHAT = {**SGLANG, "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True,
               "return_prompt_token_ids": False, "return_meta_info": False, "use_audio_in_video": False}
ASK = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3, tmp_path_factory):
    """The tiny model with a BOS token added to plain prompts (add_bos_token), so add_special_tokens shows."""
    d = tmp_path_factory.mktemp("bos") / "tiny-bos"
    shutil.copytree(tiny_qwen3, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("dropin"), "--log-level", "debug", "--local-prefill-tokens", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def greedy(client, model, prompt, max_tokens: int = 8, **kw) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     **kw).choices[0].text


# -- vLLM's and SGLang's fields ---------------------------------------------------------------------

def test_their_fields_at_their_defaults_change_nothing(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, temperature=0)
    for extras in (VLLM_CHAT, SGLANG_CHAT):
        r = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, temperature=0, extra_body=extras)
        assert r.choices[0].message.content == plain.choices[0].message.content
    want = greedy(client, model, "Once upon a time")
    for extras in (VLLM_COMPLETION, SGLANG):
        assert greedy(client, model, "Once upon a time", extra_body=extras) == want


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_their_fields_beyond_what_trnd_does_are_400_naming_them(server, model, endpoint):
    base = {"model": model, "max_tokens": 2, **({"messages": ASK} if "chat" in endpoint else {"prompt": "hi"})}
    for name in AT_DEFAULT:
        r = post(server, endpoint, {**base, name: "not-a-default"})
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"] and err["type"] == "invalid_request_error", err


def test_include_stop_str_in_output_streamed_and_whole(client, model):
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24,
                                     temperature=0).choices[0].text
    stop = text[4:7]
    at = text.index(stop)
    for kw, want in (({}, text[:at]), ({"include_stop_str_in_output": True}, text[:at + len(stop)])):
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                      stop=[stop], extra_body=kw)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop], stream=True,
            extra_body=kw) if c.choices)
        assert streamed == want


def test_truncate_prompt_tokens_keeps_the_last_or_the_first(client, model):
    ids = list(range(40, 70))
    r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8
    assert r.choices[0].text == greedy(client, model, ids[-8:], max_tokens=4)
    r = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 8, "truncation_side": "right"})
    assert r.choices[0].text == greedy(client, model, ids[:8], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=ids, max_tokens=4, extra_body={"truncate_prompt_tokens": -2})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_echo_prepends_the_prompt(client, model):
    tail = greedy(client, model, "Once upon a time")
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == "Once upon a time" + tail
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == "Once upon a time" + tail


def test_chat_continues_the_final_message_and_echoes_it(server, client, model):
    msgs = ASK + [{"role": "assistant", "content": "Once upon a"}]
    body = {"model": model, "messages": msgs, "continue_final_message": True}
    rendered = post(server, "/detokenize", {"tokens": post(server, "/tokenize", body).json()["tokens"]}).json()
    assert rendered["prompt"].endswith("<|im_start|>assistant\nOnce upon a")  # no end of turn after it
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "echo": True})
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                           extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == "Once upon a" + plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_body={
            "continue_final_message": True, "add_generation_prompt": True})
    assert e.value.body["param"] == "continue_final_message"


def test_template_extras_render_as_asked(server, model):
    def rendered(**kw) -> str:
        r = post(server, "/tokenize", {"model": model, "messages": ASK, **kw})
        assert r.status_code == 200, r.text
        return post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]

    assert rendered().endswith("<|im_start|>assistant\n")
    assert rendered(add_generation_prompt=False).endswith("Tell me a story<|im_end|>\n")
    assert rendered(reasoning_effort="none").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}|{% endfor %}{{ documents[0].text }}"
    assert rendered(chat_template=template, documents=[{"title": "t", "text": "DOC"}]) == \
        "[user] Tell me a story|DOC"
    assert rendered(add_special_tokens=True).startswith("<|endoftext|><|im_start|>")
    r = post(server, "/v1/chat/completions", {"model": model, "messages": ASK, "chat_template": "{% for %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_add_special_tokens_on_completions(server, model):
    with_bos = post(server, "/tokenize", {"prompt": "hi"}).json()["tokens"]
    without = post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()["tokens"]
    assert with_bos[1:] == without and len(with_bos) == len(without) + 1
    for flag, n in ((None, len(with_bos)), (False, len(without))):
        extra = {} if flag is None else {"add_special_tokens": flag}
        r = post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1, **extra})
        assert r.json()["usage"]["prompt_tokens"] == n


def test_logprob_tokens_as_ids_request_id_and_priority(server, client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                   "request_id": "my-req-1", "priority": -3})
    assert r.id == "chatcmpl-my-req-1"
    for lp in r.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", lp.token) and all(re.fullmatch(r"token_id:\d+", t.token)
                                                               for t in lp.top_logprobs)
    # the engine requests carry the priority: decode's, and the prefill peer's (its log, at debug)
    trace = httpx.get(f"{server.url}/admin/requests/chatcmpl-my-req-1").json()
    assert any("priority=-3" in str(p) for t in trace["traces"] for p in t["phases"]), trace
    assert re.search(r"p\d+/chatcmpl-my-req-1.*queued: .*priority=-3", server.log_path.read_text())
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2, extra_body={"request_id": "a b"})
    assert e.value.body["param"] == "request_id"


def test_a_request_id_in_flight_is_409(server, model):
    started, done = threading.Event(), threading.Event()

    def hold():
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "request_id": "twice"}) as r:
            for _ in r.iter_lines():
                started.set()
                if done.is_set():
                    break

    t = threading.Thread(target=hold)
    t.start()
    assert started.wait(60)
    r = post(server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, "request_id": "twice"})
    done.set()
    t.join(60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_request_id", r.text


def test_sglang_regex_constrains_the_reply(client, model):
    r = client.completions.create(model=model, prompt="Code:", max_tokens=20, temperature=0,
                                  extra_body={"regex": "[A-Z]{3}-[0-9]{4}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{4}", r.choices[0].text)


# -- batched prompts --------------------------------------------------------------------------------

def test_batched_prompts_strings_and_token_lists(client, model):
    prompts = ["Once upon a time", "The cat"]
    singles = [greedy(client, model, p) for p in prompts]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    lens = [client.completions.create(model=model, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert r.usage.prompt_tokens == sum(lens) and r.usage.completion_tokens == 32
    ids = [[40, 41, 42, 43], [50, 51]]
    streamed = ["", ""]
    for c in client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == [greedy(client, model, p) for p in ids]


# -- tokenizer routes, /version, /v1/models/{id}, error types ---------------------------------------

def test_tokenizer_routes_version_and_model_card(server, client, model):
    r = post(server, "/tokenize", {"model": model, "prompt": "Once upon", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 512
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == "<|endoftext|>Once upon"
    bad = post(server, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"prompt": "x", "messages": ASK}).status_code == 400
    assert httpx.get(f"{server.url}/version").json()["version"] == __import__("trnd").__version__
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"


# -- the Responses API ------------------------------------------------------------------------------

def test_responses_text_whole_and_streamed(client, model):
    r = client.responses.create(model=model, input="Tell me a story", instructions="Be brief", max_output_tokens=8,
                                temperature=0)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    events = list(client.responses.create(model=model, input="Tell me a story", instructions="Be brief",
                                          max_output_tokens=8, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


def test_responses_continue_by_previous_response_id_and_store(client, model):
    first = client.responses.create(model=model, input="Tell me a story", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=model, input="More", max_output_tokens=4, temperature=0,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the same conversation sent whole gives the same reply
    whole = client.responses.create(model=model, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"}])
    assert whole.output_text == second.output_text
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="More", max_output_tokens=2, previous_response_id=unstored.id)
    assert e.value.body["code"] == "previous_response_not_found"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"]}}


def test_responses_function_calls_and_their_outputs(client, model):
    r = client.responses.create(model=model, input="Weather in Paris?", tools=[TOOL], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    events = list(client.responses.create(model=model, input="Weather in Paris?", tools=[TOOL],
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                          temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        calls[0].arguments
    follow = client.responses.create(model=model, previous_response_id=r.id, tools=[TOOL], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens


def test_responses_json_format_and_refusals(server, client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.responses.create(model=model, input="Answer", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    for body, param in (({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
                        ({"background": True}, "background"), ({"some_field": 1}, "some_field"),
                        ({"model": "nope"}, "model")):
        r = post(server, "/v1/responses", {"model": model, "input": "hi", **body})
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


@pytest.fixture(scope="module")
def reasoning_server(tiny_qwen3, tmp_path_factory):
    s = Server(tiny_qwen3, tmp_path_factory.mktemp("reasoning"), "--aggregated", "--reasoning-parser", "deepseek_r1")
    yield s
    s.stop()


def test_responses_reasoning_items(reasoning_server):
    """deepseek_r1: the reply is reasoning until </think>, which the random model never writes."""
    c = reasoning_server.client(timeout=60)
    m = c.models.list().data[0].id
    r = c.responses.create(model=m, input="Think", max_output_tokens=6, temperature=0, reasoning={"effort": "high"})
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(c.responses.create(model=m, input="Think", max_output_tokens=6, temperature=0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == r.output[0].content[0].text


def test_metrics_counters_are_counters_with_no_created_series(server, client, model):
    """As vLLM: no `*_created` series, counters typed counter, model_name on every trnd series."""
    client.completions.create(model=model, prompt="hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    assert "_created" not in text
    samples = [ln for ln in text.splitlines() if ln.startswith("trnd:")]
    assert samples and all(f'model_name="{model}"' in ln for ln in samples), \
        [ln for ln in samples if "model_name" not in ln]
    for line in text.splitlines():
        if line.startswith("# TYPE ") and line.split()[2].endswith("_total"):
            assert line.split()[3] == "counter", line


def test_the_deployment_from_its_front_port(server):
    """/admin/state names the prefill peer's admin URL; `trnd top` on the front port shows both processes."""
    state = httpx.get(f"{server.url}/admin/state").json()
    admin = state["peers"][0]["admin"]
    assert admin and httpx.get(f"{admin}/admin/state").json()["role"] == "prefill"
    top = subprocess.run([sys.executable, "-m", "trnd", "top", "--once", server.url], capture_output=True, text=True,
                         timeout=60)
    assert top.returncode == 0, top.stdout + top.stderr
    assert server.url.split("://")[1] in top.stdout and admin.split("://")[1] in top.stdout, top.stdout
