"""The chat-only parts of a request around the engine: what tools and reasoning do to the prompt and
the grammar (`plan_chat`), and what the model's text becomes in the reply (`ChoiceText`: reasoning,
content and tool calls, streamed or whole, from the same incremental parsers)."""

from __future__ import annotations

from dataclasses import dataclass, field

import jinja2

from trnd.api import protocol as P
from trnd.api.errors import invalid
from trnd.api.reasoning import END, ReasoningParser
from trnd.api.structured import DEFAULT_LIMITS, GrammarLimits, check_depth, find_grammar, request_grammar
from trnd.api.tools import make_parser, tool_grammar
from trnd.model.tokenizer import compile_template
from trnd.sampling_params import GrammarSpec

RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
MAX_TEMPLATE_CHARS = 64 * 1024


@dataclass
class ChatPlan:
    template_kwargs: dict = field(default_factory=dict)
    tool_parser: str | None = None  # parse tool calls out of the reply with this parser
    reasoning_parser: str | None = None
    tool_spec: GrammarSpec | None = None  # what tool_choice required / named imposes
    parallel: bool = True


def plan_chat(req: P.ChatCompletionRequest, tool_call_parser: str, reasoning_parser: str,
              limits: GrammarLimits = DEFAULT_LIMITS) -> ChatPlan:
    plan = ChatPlan(reasoning_parser=None if reasoning_parser == "none" else reasoning_parser)
    kwargs = dict(req.chat_template_kwargs or {})
    for k in RESERVED_TEMPLATE_KWARGS:
        if k in kwargs:
            raise invalid(f"chat_template_kwargs.{k}", f"chat_template_kwargs.{k} is set by trnd, not the request")
    plan.parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools")
        plan.template_kwargs = kwargs
        return plan
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise invalid(f"tools[{i}].type", f"tools[{i}].type {t.type!r} is not supported (function)")
        if t.function.parameters is not None and not isinstance(t.function.parameters, dict):
            raise invalid(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
        if t.function.parameters is not None:  # before anything walks it (a 400-deep schema was a 500)
            check_depth(f"tools[{i}].function.parameters", t.function.parameters, limits)
    defs = [{"name": t.function.name, "description": t.function.description,
             "parameters": t.function.parameters or {"type": "object", "properties": {}}} for t in req.tools]
    choice = "auto" if choice is None else choice
    if choice == "none":  # the model is not offered the tools and its text is not parsed for calls
        plan.template_kwargs = kwargs
        return plan
    parser = None if tool_call_parser == "none" else tool_call_parser
    if parser is None:
        raise invalid("tool_choice", "tool calls need a tool_call_parser: this server is configured without one")
    plan.tool_parser = parser
    kwargs["tools"] = [{"type": "function", "function": {k: v for k, v in d.items() if v is not None}} for d in defs]
    plan.template_kwargs = kwargs
    if isinstance(choice, P.NamedToolChoice):
        named = [d for d in defs if d["name"] == choice.function.name]
        if not named:
            raise invalid("tool_choice.function.name", f"tool_choice.function.name {choice.function.name!r} is not "
                                                       "one of the tools")
        plan.tool_spec = tool_grammar(named, parser, parallel=False)
    elif choice == "required":
        plan.tool_spec = tool_grammar(defs, parser, plan.parallel)
    elif choice != "auto":
        raise invalid("tool_choice", f"tool_choice {choice!r} is not one of none, auto, required or a named function")
    return plan


def render_chat(req, tokenizer, messages: list[dict], plan: ChatPlan) -> tuple[str, str]:
    """The prompt text for the engine, and what `echo` puts before the reply: the final message's text when
    the reply continues it (continue_final_message, or add_generation_prompt false with a final message
    of the reply's role), as vLLM does."""
    cont = bool(req.continue_final_message)
    if cont and req.add_generation_prompt:
        raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                "true: the reply either continues the final message or starts one")
    add_generation_prompt = not cont if req.add_generation_prompt is None else req.add_generation_prompt
    kwargs = dict(plan.template_kwargs)
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:  # as vLLM: templates that read it see it; thinking follows it
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    if req.chat_template is not None:
        if len(req.chat_template) > MAX_TEMPLATE_CHARS:
            raise invalid("chat_template", f"chat_template is longer than {MAX_TEMPLATE_CHARS} characters")
        try:
            compile_template(req.chat_template)
        except jinja2.TemplateError as e:
            raise invalid("chat_template", f"chat_template does not compile: {e}") from None
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=cont, chat_template=req.chat_template, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # "roles must alternate", no template at all...
        param = "continue_final_message" if cont and "final message" in str(e) else (
            "chat_template" if req.chat_template is not None else "messages")
        raise invalid(param, f"{param}: the chat template refused the request: {e}") from None
    role = "assistant" if add_generation_prompt else messages[-1]["role"]
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == role else ""
    return prompt, echo


def chat_grammar(req: P.ChatCompletionRequest, plan: ChatPlan, prompt: str, engine) -> GrammarSpec | None:
    """The request's grammar, compiled on this thread (tests); the server finds it with chat_grammar_found
    and compiles it off its loop (structured.compile_grammar)."""
    return request_grammar(req, engine, plan.tool_spec, _after(plan, prompt))


def chat_grammar_found(req: P.ChatCompletionRequest, plan: ChatPlan, prompt: str, limits: GrammarLimits):
    """(spec, field) of the request's grammar, or None; with a reasoning parser it starts after `</think>`,
    unless the prompt already closed the think block (enable_thinking: false)."""
    return find_grammar(req, plan.tool_spec, _after(plan, prompt), limits)


def _after(plan: ChatPlan, prompt: str) -> str | None:
    return END if plan.reasoning_parser and not prompt.rstrip().endswith(END) else None


class ChoiceText:
    """One choice's text, split into reasoning, content and tool calls as it arrives."""

    def __init__(self, plan: ChatPlan):
        self.reasoning = ReasoningParser(plan.reasoning_parser) if plan.reasoning_parser else None
        self.tools = make_parser(plan.tool_parser) if plan.tool_parser else None
        # parallel_tool_calls = false: at most one call. tool_choice required / named asks the grammar for
        # one; with auto the reply is free text, so calls after the first are dropped here (their text too).
        self.parallel = plan.parallel
        self.reasoning_text: list[str] = []
        self.content: list[str] = []

    def push(self, text: str, final: bool = False) -> list[P.Delta]:
        """The stream deltas for this text, one chunk each ([]: nothing to send yet). As OpenAI sends
        them: a call's first chunk has id, type and name with arguments "", then argument fragments."""
        reasoning, content = (self.reasoning.push(text, final) if self.reasoning else ("", text))
        calls: list[tuple] = []
        if self.tools is not None:
            d = self.tools.push(content) if content else None
            if final:
                tail = self.tools.finish()
                if d is None:
                    d = tail
                else:
                    d.content += tail.content
                    d.calls += tail.calls
            if d is not None:
                content, calls = d.content, d.calls
                if not self.parallel:
                    calls = [c for c in calls if c[0] == 0]
        self.reasoning_text.append(reasoning)
        self.content.append(content)
        out = []
        if reasoning or content:
            out.append(P.Delta(content=content or None, reasoning_content=reasoning or None,
                               reasoning=reasoning or None))
        for i, cid, name, args in calls:
            if cid is None and out and out[-1].tool_calls and out[-1].tool_calls[0].index == i \
                    and out[-1].tool_calls[0].id is None:
                out[-1].tool_calls[0].function.arguments += args  # fragments of one step: one chunk
            else:
                fn = P.FunctionDelta(name, args if cid is None else "")
                out.append(P.Delta(tool_calls=[P.ToolCallDelta(i, fn, cid, "function" if cid else None)]))
                if cid is not None and args:
                    out.append(P.Delta(tool_calls=[P.ToolCallDelta(i, P.FunctionDelta(arguments=args))]))
        return out

    @property
    def has_calls(self) -> bool:
        return bool(self.tools and self.tools.calls)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.has_calls else reason

    def message(self) -> P.ChatMessageOut:
        content = "".join(self.content)
        reasoning = "".join(self.reasoning_text) or None
        calls = None
        if self.has_calls:
            kept = self.tools.calls if self.parallel else self.tools.calls[:1]
            calls = [P.ToolCallOut(c.id, "function", P.FunctionOut(c.name, c.arguments)) for c in kept]
            content = content if content.strip() else None
        return P.ChatMessageOut("assistant", content, reasoning, reasoning, calls)
