"""OpenAI's Responses API on the chat machinery: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a ChatCompletionRequest (api/response_input.py: the input items as chat messages after
the stored conversation of `previous_response_id`), so it is validated, rendered, constrained and run
exactly as /v1/chat/completions is. Its text goes through the same reasoning and tool-call parsers
(ChoiceText) into output items: a `reasoning` item, a `message` with `output_text`, `function_call`s.
`OutputItems` builds those items from the parsers' deltas and, streamed, writes the Responses events as it
goes, so a streamed and a whole reply are built by the same code.

Stored responses (`store`, default true) live in a bounded in-memory store (ResponseStore): the latest
MAX_STORED, up to MAX_STORED_CHARS of conversation text; an evicted or unknown id is a 404.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd.api import protocol as P
from trnd.api.chat import ChoiceText, chat_grammar_found, plan_chat, render_chat
from trnd.api.intake import decode, encode, prefill_hint, salt_of
from trnd.api.job import Job
from trnd.api.params import chat_messages, to_sampling_params
from trnd.api.response_input import ResponsesRequest, renamed, response_id, to_chat_request
from trnd.api.stream import EventStream, until_disconnect
from trnd.api.structured import GrammarLimits, compile_grammar
from trnd.http.app import json_response, state_of
from trnd.http.errors import APIError, ErrorInfo

MAX_STORED = 1024
MAX_STORED_CHARS = 64 * 2**20


# -- the reply's objects ----------------------------------------------------------------------------

class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list = msgspec.field(default_factory=list)
    logprobs: list = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct):
    text: str
    type: str = "reasoning_text"


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "in_progress"
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    id: str
    content: list[ReasoningText]
    summary: list = msgspec.field(default_factory=list)
    status: str = "in_progress"


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"


Item = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class Usage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[Item]
    parallel_tool_calls: bool
    tool_choice: object
    tools: list
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    previous_response_id: str | None
    instructions: str | None
    reasoning: dict | None
    text: dict
    metadata: dict | None
    store: bool
    truncation: str = "disabled"
    user: str | None = None
    usage: Usage | None = None
    error: ErrorInfo | None = None
    incomplete_details: dict | None = None


# -- output items from the parsers' deltas ----------------------------------------------------------

class OutputItems:
    """The reply's output items, grown from ChoiceText deltas (reasoning, content, tool-call fragments).
    With `events` set, each change also becomes a Responses stream event there (bytes, SSE)."""

    def __init__(self, events: list[bytes] | None = None, seq: int = 0):
        self.items: list[Item] = []
        self.open: Item | None = None
        self.events, self.seq = events, seq
        self.calls: dict[int, FunctionCallItem] = {}  # tool-call index -> its item

    def emit(self, type: str, **fields) -> None:
        if self.events is not None:
            fields["type"], fields["sequence_number"] = type, self.seq
            self.seq += 1
            self.events.append(b"event: " + type.encode() + b"\ndata: " + msgspec.json.encode(fields) + b"\n\n")

    def push(self, delta: P.Delta) -> None:
        if delta.reasoning_content:
            self._text(ReasoningItem, delta.reasoning_content)
        if delta.content:
            self._text(MessageItem, delta.content)
        for call in delta.tool_calls or []:
            if call.id is not None:
                self._start(FunctionCallItem(f"fc_{uuid.uuid4().hex}", call.id, call.function.name or ""))
                self.calls[call.index] = self.open
            item = self.calls.get(call.index)
            if item is not None and call.function.arguments:
                item.arguments += call.function.arguments
                self.emit("response.function_call_arguments.delta", item_id=item.id, output_index=self._index(item),
                          delta=call.function.arguments)

    def _index(self, item: Item) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _start(self, item: Item) -> None:
        self.close()
        self.items.append(item)
        self.open = item
        self.emit("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if not isinstance(item, FunctionCallItem):
            part = OutputText("") if isinstance(item, MessageItem) else ReasoningText("")
            item.content.append(part)
            self.emit("response.content_part.added", item_id=item.id, output_index=len(self.items) - 1,
                      content_index=0, part=part)

    def _text(self, kind: type, text: str) -> None:
        if not isinstance(self.open, kind):
            self._start(kind(f"{'msg' if kind is MessageItem else 'rs'}_{uuid.uuid4().hex}", []))
        item = self.open
        item.content[0].text += text
        what = "output_text" if kind is MessageItem else "reasoning_text"
        extra = {"logprobs": []} if kind is MessageItem else {}
        self.emit(f"response.{what}.delta", item_id=item.id, output_index=len(self.items) - 1, content_index=0,
                  delta=text, **extra)

    def close(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item.status = status
        index = self._index(item)
        if isinstance(item, FunctionCallItem):
            self.emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                      arguments=item.arguments)
        else:
            part = item.content[0]
            what = "output_text" if isinstance(item, MessageItem) else "reasoning_text"
            extra = {"logprobs": []} if isinstance(item, MessageItem) else {}
            self.emit(f"response.{what}.done", item_id=item.id, output_index=index, content_index=0, text=part.text,
                      **extra)
            self.emit("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part)
        self.emit("response.output_item.done", output_index=index, item=item)


# -- the store --------------------------------------------------------------------------------------

class ResponseStore:
    """Stored responses by id, least recently used first: the reply (GET) and the conversation that a
    follow-up's previous_response_id continues (chat messages, instructions excluded as OpenAI does)."""

    def __init__(self, max_items: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.max_items, self.max_chars = max_items, max_chars
        self.entries: OrderedDict[str, tuple[ResponseObject, list[P.ChatMessage], int]] = OrderedDict()
        self.chars = 0

    def get(self, rid: str) -> tuple[ResponseObject, list[P.ChatMessage]] | None:
        entry = self.entries.get(rid)
        if entry is None:
            return None
        self.entries.move_to_end(rid)
        return entry[0], entry[1]

    def put(self, obj: ResponseObject, history: list[P.ChatMessage]) -> None:
        size = sum(len(m.content if isinstance(m.content, str) else "") + len(msgspec.json.encode(m.tool_calls))
                   for m in history)
        self.entries[obj.id] = (obj, history, size)
        self.chars += size
        while self.entries and (len(self.entries) > self.max_items or self.chars > self.max_chars):
            self.chars -= self.entries.popitem(last=False)[1][2]

    def delete(self, rid: str) -> bool:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.chars -= entry[2]
        return entry is not None


def attach(app, cfg) -> None:
    app.state.responses = ResponseStore()


def routes() -> list[Route]:
    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{rid}", retrieve, methods=["GET"]),
            Route("/v1/responses/{rid}", delete, methods=["DELETE"])]


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _found(request: Request) -> tuple[ResponseObject, list[P.ChatMessage]]:
    rid = request.path_params["rid"]
    entry = _store(request).get(rid)
    if entry is None:
        raise APIError(404, f"Response with id {rid!r} not found (never stored, or evicted)", param="response_id",
                       code="response_not_found")
    return entry


async def retrieve(request: Request) -> Response:
    return json_response(_found(request)[0])


async def delete(request: Request) -> Response:
    obj, _ = _found(request)
    _store(request).delete(obj.id)
    return json_response({"id": obj.id, "object": "response.deleted", "deleted": True})


# -- POST /v1/responses -----------------------------------------------------------------------------

async def create(request: Request) -> Response | EventStream:
    arrival, st = time.monotonic(), state_of(request)
    req: ResponsesRequest = await decode(request, st, ResponsesRequest)
    store = _store(request)
    history: list[P.ChatMessage] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise APIError(404, f"Previous response with id {req.previous_response_id!r} not found (never stored, "
                                "stored with store: false, or evicted)", param="previous_response_id",
                           code="previous_response_not_found")
        history = prev[1]
    chat, turn = to_chat_request(req, history)
    try:
        api = st.cfg.api
        params, _ = to_sampling_params(chat, 1, api.max_stop, api.max_stop_chars, api.max_logit_bias,
                                       api.max_stop_token_ids)
        params.cache_salt, params.prefill_hint = salt_of(chat, request, st), prefill_hint(request)
        limits = GrammarLimits.of(api)
        plan = plan_chat(chat, api.tool_call_parser, api.reasoning_parser, limits)
        prompt, _ = render_chat(chat, st.tokenizer, chat_messages(chat), plan)
        params.grammar = await compile_grammar(st.loop.engine, chat_grammar_found(chat, plan, prompt, limits), limits)
        ids = await encode(st, prompt, False)
        job = Job(st, "chat", [ids], params, 1, session_id=req.prompt_cache_key, stream=bool(req.stream),
                  include_usage=False, prompt_param="input", arrival=arrival, plan=plan,
                  user=req.user or req.safety_identifier,
                  job_id=response_id(req, request.headers.get("x-trnd-conversation")))
    except APIError as e:
        raise renamed(e) from None
    reply = Reply(job, req, history + turn, store if req.store is not False else None)
    if req.stream:
        return EventStream(reply.events(), {"X-Request-Id": reply.obj.id}, on_close=job.release)
    try:
        result = await until_disconnect(request.receive, reply.collect())
    finally:
        job.release()
    if result is None:
        return Response(status_code=499)
    return json_response(result, headers={"X-Request-Id": result.id})


class Reply:
    """One response being produced: its object, the items from the job's text, the store once done."""

    def __init__(self, job: Job, req: ResponsesRequest, history: list[P.ChatMessage], store: ResponseStore | None):
        self.job, self.req, self.history, self.store = job, req, history, store
        tools = list(req.tools or [])
        self.obj = ResponseObject(
            id=job.id, created_at=int(time.time()), status="in_progress",
            model=job.st.model_name, output=[], parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto", tools=tools,
            temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens,
            previous_response_id=req.previous_response_id, instructions=req.instructions,
            reasoning=msgspec.structs.asdict(req.reasoning) if req.reasoning is not None else None,
            text={"format": msgspec.json.decode(msgspec.json.encode(req.text.format))} if req.text and
            req.text.format else {"format": {"type": "text"}},
            metadata=req.metadata, store=req.store is not False, user=req.user)

    def finish(self, items: OutputItems, parsed: ChoiceText, last) -> ResponseObject:
        """The completed object (stored unless store: false), from the items and the engine's last output."""
        reason = last.finish_reason if last is not None else "abort"
        status = {"length": "incomplete", "abort": "cancelled"}.get(reason, "completed")
        items.close("incomplete" if status == "incomplete" else "completed")
        obj = self.obj
        obj.output, obj.status = items.items, status
        if status == "incomplete":
            obj.incomplete_details = {"reason": "max_output_tokens"}
        reasoning = "".join(parsed.reasoning_text)
        reasoning_tokens = len(self.job.st.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        usage = self.job.usage([last])
        obj.usage = Usage(usage.prompt_tokens, InputTokensDetails(usage.prompt_tokens_details.cached_tokens),
                          usage.completion_tokens, OutputTokensDetails(reasoning_tokens), usage.total_tokens)
        if self.store is not None and status != "cancelled":
            message = parsed.message()
            calls = [P.ToolCallIn(P.FunctionCallIn(c.function.name, c.function.arguments), c.id)
                     for c in message.tool_calls or []]
            self.store.put(obj, self.history + [P.ChatMessage("assistant", message.content, tool_calls=calls or None)])
        return obj

    async def collect(self) -> ResponseObject:
        texts, _, last = await self.job.gather()
        parsed, items = ChoiceText(self.job.plan), OutputItems()
        for delta in parsed.push(texts[0], final=True):
            items.push(delta)
        return self.finish(items, parsed, last[0])

    async def events(self):
        out: list[bytes] = []
        items, parsed = OutputItems(out), ChoiceText(self.job.plan)
        items.emit("response.created", response=self.obj)
        items.emit("response.in_progress", response=self.obj)
        yield b"".join(out)
        last = None
        try:
            async with contextlib.aclosing(self.job.outputs()) as steps:
                async for _, step in steps:
                    last = step
                    out.clear()
                    for delta in parsed.push(step.text, final=step.finished):
                        items.push(delta)
                    if out:
                        yield b"".join(out)
        except Exception as e:
            err = self.job.translate(e)
            if err is None:
                err = APIError(500, "Internal server error", type="server_error", code="internal_error")
            out.clear()
            items.emit("error", code=err.code, message=err.message, param=err.param)
            self.obj.status, self.obj.error = "failed", err.body().error
            items.emit("response.failed", response=self.obj)
            yield b"".join(out)
            return
        out.clear()
        obj = self.finish(items, parsed, last)
        items.emit("response.completed" if obj.status == "completed" else "response.incomplete", response=obj)
        yield b"".join(out)
