"""A Responses API request (POST /v1/responses) as the ChatCompletionRequest that serves it: the input
items as chat messages after the stored conversation, function tools and tool_choice in chat's shape,
`text.format` as a response_format, `reasoning.effort` as chat's reasoning_effort. What the chat route
cannot serve is refused here by name, as on every route."""

from __future__ import annotations

import uuid
from typing import Annotated

import msgspec
from msgspec import Meta

from trnd.api import protocol as P
from trnd.api.errors import invalid
from trnd.http.errors import APIError
from trnd.http.ids import CONVERSATION, conversation_of


def response_id(req, header: str | None) -> str:
    """This response's id: the conversation it continues, else the one the router named (header
    x-trnd-conversation), else a new one."""
    conv = conversation_of(req.previous_response_id) if req.previous_response_id else None
    if conv is None:
        conv = header if header and CONVERSATION.fullmatch(header) else uuid.uuid4().hex
    return f"resp_{conv}_{req.request_id or uuid.uuid4().hex[:16]}"


class InputPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # input_text / output_text (a reply given back), reasoning_text, summary_text
    text: str | None = None
    annotations: list | None = None
    logprobs: list | None = None


class InputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Any input item (the fields of all the kinds trnd takes), checked by `type` in to_chat_request."""
    type: str | None = None  # "message" when absent
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    phase: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None  # reasoning
    encrypted_content: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # text | json_object | json_schema
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # default true
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the session (prefix-cache affinity), as on chat
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    stream_options: dict | None = None
    conversation: object = None
    prompt: object = None
    context_management: object = None
    prompt_cache_retention: str | None = None
    # vLLM's extras on this route
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    priority: int | None = None
    request_id: str | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None  # as on chat (http/tenant.py)


# field -> (the values accepted besides null, why the others are not)
_ONLY = {"background": ((False,), "responses are produced while the request waits"),
         "max_tool_calls": ((), "use parallel_tool_calls: false for one call"),
         "top_logprobs": ((0,), "output_text logprobs are not returned on this route"),
         "include": (([],), "no encrypted reasoning, logprobs or tool sources to include"),
         "truncation": (("disabled",), "a conversation longer than the context is a 400, never cut"),
         "prompt_cache_retention": (("in_memory",), "the prefix cache is in memory"),
         "conversation": ((), "use previous_response_id"),
         "prompt": ((), "no stored prompt templates"),
         "context_management": ((), "no context compaction"),
         "stream_options": (({}, {"include_obfuscation": False}), "no obfuscation padding")}


def _check_only(req: ResponsesRequest) -> None:
    for name, (accepted, why) in _ONLY.items():
        value = getattr(req, name)
        if value is not None and value not in accepted:
            raise invalid(name, f"{name}: {msgspec.json.encode(value).decode()} is not supported ({why})")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise invalid("text.verbosity", "text.verbosity: only medium is supported")
    r = req.reasoning
    if r is not None:
        for name in ("summary", "generate_summary"):
            if getattr(r, name) not in (None, "auto"):
                raise invalid(f"reasoning.{name}", f"reasoning.{name}: only auto is supported (the reasoning text "
                                                   "is returned whole, as reasoning_text content)")


def _text(param: str, content: str | list[InputPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "reasoning_text", "summary_text") or part.text is None:
            raise invalid(f"{param}[{j}].type", f"{param}[{j}]: only text parts are supported (input_text, "
                                                f"output_text), got {part.type!r}")
    return "".join(p.text for p in content)


def input_messages(items: str | list[InputItem]) -> list[P.ChatMessage]:
    """The input items as chat messages: function calls join the assistant turn before them, their outputs
    become tool messages, reasoning items are dropped (chat templates do not render earlier reasoning)."""
    if isinstance(items, str):
        return [P.ChatMessage("user", items)]
    out: list[P.ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"input[{i}].role", f"input[{i}].role {item.role!r} is not one of user, system, "
                                                  "developer, assistant")
            out.append(P.ChatMessage(item.role, _text(f"input[{i}].content", item.content)))
        elif kind == "function_call":
            if item.call_id is None or item.name is None:
                raise invalid(f"input[{i}]", f"input[{i}]: a function_call needs call_id and name")
            call = P.ToolCallIn(P.FunctionCallIn(item.name, item.arguments or "{}"), item.call_id)
            if out and out[-1].role == "assistant":  # one assistant turn: its text, then its calls
                out[-1].tool_calls = (out[-1].tool_calls or []) + [call]
            else:
                out.append(P.ChatMessage("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            if item.call_id is None or item.output is None:
                raise invalid(f"input[{i}]", f"input[{i}]: a function_call_output needs call_id and output")
            out.append(P.ChatMessage("tool", _text(f"input[{i}].output", item.output), tool_call_id=item.call_id))
        elif kind != "reasoning":
            raise invalid(f"input[{i}].type", f"input[{i}].type {kind!r} is not supported (message, function_call, "
                                              "function_call_output, reasoning)")
    return out


def _tools(req: ResponsesRequest) -> list[P.Tool] | None:
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.get("type") != "function":
            raise invalid(f"tools[{i}].type", f"tools[{i}].type {t.get('type')!r} is not supported (function tools "
                                              "only: trnd runs no built-in tools)")
        try:
            f = msgspec.convert(t, FunctionTool)
        except msgspec.ValidationError as e:
            raise invalid(f"tools[{i}]", f"tools[{i}]: {e}") from None
        tools.append(P.Tool(P.FunctionDef(f.name, f.description, f.parameters, f.strict)))
    return tools


def _tool_choice(choice: str | dict | None):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return P.NamedToolChoice(P.NamedFunction(choice["name"]))
    raise invalid("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}")


def _response_format(text: TextConfig | None) -> P.ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return P.ResponseFormat("json_object")
    if fmt.type == "json_schema":
        return P.ResponseFormat("json_schema", P.JsonSchemaFormat(fmt.name, fmt.description, fmt.schema, fmt.strict))
    raise invalid("text.format.type", f"text.format.type {fmt.type!r} is not one of text, json_object, json_schema")


def to_chat_request(req: ResponsesRequest, history: list[P.ChatMessage]
                    ) -> tuple[P.ChatCompletionRequest, list[P.ChatMessage]]:
    """The chat request, and this turn's messages (what the store keeps after `history`)."""
    _check_only(req)
    turn = input_messages(req.input)
    if not turn:
        raise invalid("input", "input must contain at least one item")
    system = [P.ChatMessage("system", req.instructions)] if req.instructions else []
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
        raise invalid("reasoning.effort", f"reasoning.effort {effort!r} is not one of none, minimal, low, medium, "
                                          "high, xhigh")
    chat = P.ChatCompletionRequest(
        messages=system + history + turn, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, tools=_tools(req), tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        reasoning_effort=effort, user=req.user, safety_identifier=req.safety_identifier,
        service_tier=req.service_tier, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        seed=req.seed, stop=req.stop, priority=req.priority, request_id=req.request_id, cache_salt=req.cache_salt)
    return chat, turn


def renamed(e: APIError) -> APIError:
    """A 400 from the chat pipeline with this route's names for the param (messages[3] -> input, ...)."""
    p = e.param
    if p is None:
        return e
    if p.startswith("messages"):
        new = "input"
    elif p.startswith("response_format"):
        new = "text.format" + p[len("response_format.json_schema"):] if p.startswith(
            "response_format.json_schema") else "text.format"
    else:
        new = {"max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort"}.get(p, p)
    e.message, e.param = e.message.replace(p, new), new
    return e
