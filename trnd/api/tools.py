r"""Tool calls in model text: the `hermes` parser (Qwen2.5/Qwen3: `<tool_call>{"name", "arguments"}</tool_call>`)
and `llama3_json` (`{"name", "parameters"}` objects, `;`-separated, optionally after `<|python_tag|>`),
both incremental, so streaming and non-streaming replies come from the same code and agree.

Text the parser cannot read as a call (a name with an invalid escape such as `get\_weather`, a lone surrogate,
an object that is no call) comes back as content, streamed or not, as vLLM's hermes parser returns it.

A parser is pushed text as it is generated and returns (content, tool-call deltas) in OpenAI's stream
shape: a call's first delta has id, type and function.name with arguments "", the next ones carry
argument fragments. Arguments stream as the model writes them, once the name has been seen; the
concatenated fragments are the call's `arguments` string. Text that may be the start of a tag is held
back until it is known not to be (tags split across tokens).

`tool_grammar` builds the grammar that `tool_choice` "required" or a named function imposes, in the
format the configured parser reads.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from trnd.sampling_params import GrammarSpec

PARSERS = ("hermes", "llama3_json")
MAX_PARALLEL_CALLS = 4  # under a grammar: a model that never stops calling still ends

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Delta:
    """One step's output: content text and tool-call deltas (index, id|None, name|None, arguments|None)."""
    content: str = ""
    calls: list[tuple[int, str | None, str | None, str | None]] = field(default_factory=list)


def _encodable(text: str) -> bool:
    """No lone surrogate (JSON's "\\ud800" decodes to one; UTF-8, so the reply's JSON, cannot hold it)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _text(raw: str) -> str | None:
    """A JSON string's body as text; None where it is not valid JSON or holds a lone surrogate."""
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None
    return value if _encodable(value) else None


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (kept back: it may become tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _Object:
    """One JSON object scanned char by char: depth and strings tracked, so its end and the span of its
    arguments value are known without waiting for the text after it."""

    def __init__(self):
        self.buf = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.done = False
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_container = False
        self.call: ToolCall | None = None  # set once the name is known
        self.unnamed = False  # its name is no valid JSON string: not a call

    def feed(self, text: str) -> str:
        """Consume text up to the object's end; returns what follows it."""
        for k, ch in enumerate(text):
            self.buf += ch
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.args_start is not None and self.args_end is None and self.args_container and self.depth == 1:
                    self.args_end = len(self.buf)
            elif ch == "," and self.depth == 1 and self.args_start is not None and self.args_end is None:
                self.args_end = len(self.buf) - 1
            if self.name is None and not self.unnamed and self.depth >= 1:
                m = _HEADER.match(self.buf)
                if m:
                    self.name = _text(m.group(1))
                    if self.name is None:  # `get\_weather`, a lone surrogate: no call; the object comes back as text
                        self.unnamed = True
                    else:
                        self.args_start = m.end()
            if self.depth == 0 and self.buf.strip():
                if self.args_start is not None and self.args_end is None:
                    self.args_end = len(self.buf) - 1
                self.done = True
                return text[k + 1:]
            if self.args_start is not None and len(self.buf) == self.args_start + 1:
                self.args_container = ch in "{["
        return ""

    def streamable(self) -> str:
        """The arguments text known so far (containers stream; a scalar value comes when complete)."""
        if self.args_start is None or (not self.args_container and self.args_end is None):
            return ""
        end = self.args_end if self.args_end is not None else len(self.buf)
        return self.buf[self.args_start:end].rstrip() if self.args_end is not None else self.buf[self.args_start:end]

    def parsed(self) -> tuple[str, str] | None:
        """(name, arguments JSON) of a complete object, when it is a call."""
        try:
            obj = json.loads(self.buf)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _encodable(obj["name"]):
            return None
        args = json.dumps(obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)
        return obj["name"], args if _encodable(args) else json.dumps(json.loads(args))  # lone surrogates stay escaped


class ToolParser:
    """Shared machinery: subclasses find where call objects start and what separates them."""
    OPEN = ""  # the text that opened a call object, given back when it turns out not to be one

    def __init__(self):
        self.calls: list[ToolCall] = []
        self._obj: _Object | None = None
        self._pending = ""  # text not yet decided
        self._sent = 0  # argument chars of the current call already emitted

    # -- the current call object --
    def _feed_object(self, text: str, out: Delta) -> str:
        obj = self._obj
        rest = obj.feed(text)
        if obj.name is not None and obj.call is None:
            obj.call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj.name)
            self.calls.append(obj.call)
            out.calls.append((len(self.calls) - 1, obj.call.id, obj.name, ""))
            self._sent = 0
        if obj.name is not None:
            args = obj.streamable()
            if len(args) > self._sent:
                piece = args[self._sent:]
                self._sent = len(args)
                obj.call.arguments += piece
                out.calls.append((len(self.calls) - 1, None, None, piece))
        if obj.done:
            self._obj = None
            called = obj.name is not None
            if not called:  # name after arguments, or other keys: the whole call at once
                parsed = obj.parsed()
                if parsed is None:
                    out.content += self.OPEN + obj.buf  # not a call after all: it is text
                else:
                    called = True
                    call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", *parsed)
                    self.calls.append(call)
                    out.calls.append((len(self.calls) - 1, call.id, call.name, ""))
                    out.calls.append((len(self.calls) - 1, None, None, call.arguments))
            self._after_object(called)
        return rest

    def _after_object(self, called: bool) -> None:
        pass

    def push(self, text: str) -> Delta:
        out = Delta()
        self._step(self._pending + text, out, final=False)
        return out

    def finish(self) -> Delta:
        out = Delta()
        self._step(self._pending, out, final=True)
        if self._obj is not None and self._obj.name is None:
            out.content += self.OPEN + self._obj.buf  # an unfinished object that never named a call
        self._obj, self._pending = None, ""
        return out

    def _step(self, text: str, out: Delta, final: bool) -> None:
        raise NotImplementedError


class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._closing = False  # after a call object: expecting </tool_call>

    def _after_object(self, called: bool) -> None:
        self._closing = called  # else the closing tag stays in the text it belongs to

    def _step(self, text: str, out: Delta, final: bool) -> None:
        self._pending = ""
        while text:
            if self._obj is not None:
                text = self._feed_object(text, out)
                continue
            if self._closing:
                stripped = text.lstrip()
                if stripped.startswith(self.CLOSE):
                    text, self._closing = stripped[len(self.CLOSE):], False
                    continue
                if self.CLOSE.startswith(stripped) and not final:
                    self._pending = text
                    return
                self._closing = False  # no closing tag: carry on with text
                text = stripped
                continue
            at = text.find(self.OPEN)
            if at >= 0:
                self._emit(text[:at], out)
                text = text[at + len(self.OPEN):]
                self._obj = _Object()
                continue
            keep = 0 if final else _held(text, self.OPEN)
            self._emit(text[:len(text) - keep], out)
            self._pending = text[len(text) - keep:]
            return

    def _emit(self, text: str, out: Delta) -> None:
        if self.calls and not text.strip():
            return  # whitespace between and after calls is not content
        out.content += text


class Llama3JsonParser(ToolParser):
    """Calls only when the reply starts with a JSON object (or <|python_tag|>); then `;` separates them."""
    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self._mode: str | None = None  # None: undecided, "text", "calls"

    def _step(self, text: str, out: Delta, final: bool) -> None:
        self._pending = ""
        while text:
            if self._mode == "text":
                out.content += text
                return
            if self._obj is not None:
                text = self._feed_object(text, out)
                continue
            stripped = text.lstrip()
            if self._mode is None and stripped.startswith(self.TAG):
                text, self._mode = stripped[len(self.TAG):], "calls"
                continue
            if self._mode == "calls" and stripped.startswith(";"):
                text = stripped[1:]
                continue
            if stripped.startswith("{"):
                self._mode = "calls"
                self._obj = _Object()
                text = stripped
                continue
            if not stripped or (self._mode is None and self.TAG.startswith(stripped)):
                if not final:
                    self._pending = text
                return
            if self._mode is None:
                self._mode = "text"
                continue
            return  # trailing text after the calls: dropped, as vLLM does


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool_call_parser {name!r} (one of {', '.join(PARSERS)})")


# -- the grammar tool_choice imposes -----------------------------------------------------------------

SAFE_INT = 2**53 - 1


def bounded(schema):
    """The schema tightened so that a model that rambles still ends: unbounded integers held to JSON's
    safe range (what JavaScript clients can read anyway), objects that list `properties` closed to
    other keys (as OpenAI's strict mode requires). Anything valid under it is valid under the original."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    t = schema.get("type")
    if t == "integer" or (isinstance(t, list) and "integer" in t):
        if not any(k in schema for k in ("maximum", "exclusiveMaximum")):
            out["maximum"] = SAFE_INT
        if not any(k in schema for k in ("minimum", "exclusiveMinimum")):
            out["minimum"] = -SAFE_INT
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _call_schema(tool: dict, args_key: str) -> dict:
    params = bounded(tool.get("parameters") or {"type": "object"})
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def tool_grammar(tools: list[dict], parser: str, parallel: bool, after: str | None = None) -> GrammarSpec:
    """One call (or up to MAX_PARALLEL_CALLS) of one of `tools`, in the parser's format, its arguments
    valid against the tool's parameters schema."""
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    schemas = [_call_schema(t, args_key) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    if parser == "llama3_json":
        call, sep = f"%json {json.dumps(schema)}", '"; "'
    else:
        call, sep = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"', '"\\n"'
    more = f" ({sep} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
    return GrammarSpec(kind="lark", value=f"start: call{more}\ncall: {call}\n", after=after)
