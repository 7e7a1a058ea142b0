"""Tool-call and reasoning parsers on recorded model texts (Qwen3 / Hermes, Llama 3.1 JSON, DeepSeek-R1
style), streamed at every split: one character at a time, in chunks, and at a real tokenizer's token
boundaries. Streaming and non-streaming must agree, and both must match what the text says."""

from __future__ import annotations

import json

import pytest

from trnd.api.chat import ChatPlan, ChoiceText
from trnd.api.reasoning import ReasoningParser
from trnd.api.tools import HermesParser, Llama3JsonParser, bounded, tool_grammar

# Recorded from Qwen2.5-7B-Instruct / Qwen3-8B (hermes) and Llama-3.1-8B-Instruct (llama3_json) replies.
QWEN_TWO_CALLS = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
                  '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": '
                  '"San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>')
QWEN_TEXT_THEN_CALL = ('Sure, let me look that up.\n<tool_call>\n{"name": "search", "arguments": {"query": '
                       '"a \\"quoted\\" }brace{ and </tool_call> inside", "filters": [{"k": 1}, {"k": [2, 3]}]}}\n</tool_call>')
QWEN_NO_CALL = "The capital of France is Paris. A <tool is not a call, nor is <tool_call without JSON."
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris; France", "unit": "celsius"}}'
LLAMA_TWO = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
QWEN3_THINK = "<think>\nThe user wants the weather. I should call the tool.\n</think>\n\n" + QWEN_TWO_CALLS
R1 = "Okay, 2 + 2: that is 4.\n</think>\n\nThe answer is **4**."


def _splits(text):
    yield [text]
    yield list(text)
    for n in (2, 3, 5, 11):
        yield [text[i:i + n] for i in range(0, len(text), n)]


def _tokens(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k], skip_special_tokens=False)
        if not cur.endswith("\ufffd"):
            pieces.append(cur[len(prev):])
            prev = cur
    return pieces


def _drive(parser_cls, chunks):
    p = parser_cls()
    content, calls = "", {}
    for d in [*(p.push(c) for c in chunks), p.finish()]:
        content += d.content
        for i, cid, name, args in d.calls:
            if cid is not None:
                assert i not in calls and name and args == "", "a call's first delta: id, name, arguments ''"
                calls[i] = [name, ""]
            else:
                assert i in calls, "argument fragments only after the call's first delta"
                calls[i][1] += args
    return content, [tuple(c) for _, c in sorted(calls.items())]


def test_unreadable_calls_come_back_as_content():
    """A call whose name holds an invalid JSON escape (`get\\_weather`) or a lone surrogate was a 500 (and the
    streamed form ended with an error event): it is text, streamed or not, as vLLM's hermes parser returns it.
    A lone surrogate inside arguments stays escaped (the reply's UTF-8 cannot hold it)."""
    bad_names = ['{"name": "get\\_weather", "arguments": {"a": 1}}', '{"name": "get\\ud800x", "arguments": {}}']
    for obj in bad_names:
        for text in (f"<tool_call>\n{obj}\n</tool_call>", f"see <tool_call>{obj}</tool_call> done"):
            for chunks in _splits(text):
                assert _drive(HermesParser, chunks) == (text, []), chunks
        for chunks in _splits(obj):
            assert _drive(Llama3JsonParser, chunks) == (obj, []), chunks
    late = '<tool_call>{"arguments": {"a": "\\ud800"}, "name": "f"}</tool_call>'
    for chunks in _splits(late):
        content, calls = _drive(HermesParser, chunks)
        assert content == "" and calls == [("f", '{"a": "\\ud800"}')]
        calls[0][1].encode("utf-8")


@pytest.mark.parametrize("text, content, calls", [
    (QWEN_TWO_CALLS, "", [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
                          ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"})]),
    (QWEN_TEXT_THEN_CALL, "Sure, let me look that up.\n",
     [("search", {"query": 'a "quoted" }brace{ and </tool_call> inside', "filters": [{"k": 1}, {"k": [2, 3]}]})]),
    (QWEN_NO_CALL, QWEN_NO_CALL, []),
    ('<tool_call>\n{"arguments": {"x": 1}, "name": "late_name"}\n</tool_call>', "", [("late_name", {"x": 1})]),
])
def test_hermes(text, content, calls, tiny_qwen3):
    from trnd.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_qwen3)
    for chunks in [*_splits(text), _tokens(tok, text)]:
        got_content, got = _drive(HermesParser, chunks)
        assert got_content == content, chunks
        assert [(n, json.loads(a)) for n, a in got] == calls


@pytest.mark.parametrize("text, content, calls", [
    (LLAMA_CALL, "", [("get_weather", {"city": "Paris; France", "unit": "celsius"})]),
    (LLAMA_TWO, "", [("a", {"x": 1}), ("b", {})]),
    ("Paris is in France {not a call}", "Paris is in France {not a call}", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call stays content
])
def test_llama3_json(text, content, calls):
    for chunks in _splits(text):
        got_content, got = _drive(Llama3JsonParser, chunks)
        assert got_content == content
        assert [(n, json.loads(a)) for n, a in got] == calls


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", QWEN3_THINK, "The user wants the weather. I should call the tool.\n", QWEN_TWO_CALLS),
    ("qwen3", "No thinking here.", "", "No thinking here."),
    ("qwen3", "<think>\ncut off while thinking", "cut off while thinking", ""),
    ("deepseek_r1", R1, "Okay, 2 + 2: that is 4.\n", "The answer is **4**."),
    ("deepseek_r1", "<think>\nhmm</think>ok", "hmm", "ok"),
    ("deepseek_r1", "never closed", "never closed", ""),
])
def test_reasoning(name, text, reasoning, content):
    for chunks in _splits(text):
        p = ReasoningParser(name)
        r = c = ""
        for piece in chunks:
            a, b = p.push(piece)
            r, c = r + a, c + b
        a, b = p.finish()
        assert (r + a, c + b) == (reasoning, content), chunks


def test_choice_text_streams_what_it_returns_whole():
    """Reasoning, then content, then calls: the stream's deltas add up to the non-streamed message."""
    plan = ChatPlan(tool_parser="hermes", reasoning_parser="qwen3")
    text = QWEN3_THINK
    for chunks in _splits(text):
        s = ChoiceText(plan)
        reasoning, content, calls = "", "", {}
        for k, piece in enumerate(chunks):
            for d in s.push(piece, final=k == len(chunks) - 1):
                assert d.reasoning == d.reasoning_content
                reasoning += d.reasoning_content or ""
                content += d.content or ""
                for tc in d.tool_calls or []:
                    if tc.id:
                        assert tc.type == "function" and tc.function.arguments == "" and tc.function.name
                        calls[tc.index] = [tc.id, tc.function.name, ""]
                    else:
                        assert tc.function.name is None
                        calls[tc.index][2] += tc.function.arguments
        whole = ChoiceText(plan)
        whole.push(text, final=True)
        msg = whole.message()
        assert msg.reasoning_content == msg.reasoning == reasoning
        assert msg.content is None and content.strip() == ""
        assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [(n, a) for _, n, a in calls.values()]
        assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"


def test_parallel_tool_calls_false_keeps_the_first_call_streamed_and_whole():
    """tool_choice auto leaves the reply free: with parallel_tool_calls false a second call is dropped, from the
    stream and the message alike (a server without the flag returns both)."""
    plan = ChatPlan(tool_parser="hermes", parallel=False)
    both = ChoiceText(ChatPlan(tool_parser="hermes"))
    both.push(QWEN_TWO_CALLS, final=True)
    assert len(both.message().tool_calls) == 2
    for chunks in _splits(QWEN_TWO_CALLS):
        s = ChoiceText(plan)
        indices, args = set(), ""
        for k, piece in enumerate(chunks):
            for d in s.push(piece, final=k == len(chunks) - 1):
                for tc in d.tool_calls or []:
                    indices.add(tc.index)
                    args += tc.function.arguments
        assert indices == {0}, chunks
        first = both.message().tool_calls[0]
        assert args == first.function.arguments
        msg = s.message()
        assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == \
            [(first.function.name, first.function.arguments)]
        assert s.finish_reason("stop") == "tool_calls"


def test_tool_grammar_and_bounded_schema():
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}]
    spec = tool_grammar(tools, "hermes", parallel=True)
    assert spec.kind == "lark" and "<tool_call>" in spec.value and "{0,3}" in spec.value
    b = bounded(tools[0]["parameters"])
    assert b["additionalProperties"] is False and b["properties"]["n"]["maximum"] == 2**53 - 1
    assert "parameters" in tool_grammar(tools, "llama3_json", parallel=False).value
