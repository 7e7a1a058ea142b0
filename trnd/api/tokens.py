"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages rendered by the chat template
exactly as /v1/chat/completions renders them) and POST /detokenize. They need no engine step, so they are
answered at once, also while the server warms up or drains."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd.api import protocol as P
from trnd.api.chat import plan_chat, render_chat
from trnd.api.errors import invalid
from trnd.api.intake import decode, encode
from trnd.api.params import chat_messages
from trnd.api.structured import GrammarLimits
from trnd.http.app import json_response, state_of


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Either `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (its TokenizeChatRequest)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt: true; messages: false (the template writes them)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    tools: list[P.Tool] | None = None
    tool_choice: str | P.NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    mm_processor_kwargs: dict | None = None  # vLLM's; text only here, so only {} or null
    echo: None = None  # what render_chat reads; never set on this route


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


def routes() -> list[Route]:
    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]


async def tokenize(request: Request) -> Response:
    st = state_of(request)
    req: TokenizeRequest = await decode(request, st, TokenizeRequest, generates=False)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("prompt", "give exactly one of prompt or messages")
    if req.mm_processor_kwargs:
        raise invalid("mm_processor_kwargs", "mm_processor_kwargs: only {} or null is supported (text only)")
    if req.messages is not None:
        plan = plan_chat(req, st.cfg.api.tool_call_parser, st.cfg.api.reasoning_parser, GrammarLimits.of(st.cfg.api))
        text, _ = render_chat(req, st.tokenizer, chat_messages(req), plan)
        ids = await encode(st, text, bool(req.add_special_tokens))
    else:
        ids = await encode(st, req.prompt, req.add_special_tokens is not False)
    strs = [st.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return json_response(TokenizeResponse(len(ids), st.loop.engine.max_model_len, ids, strs))


async def detokenize(request: Request) -> Response:
    st = state_of(request)
    req: DetokenizeRequest = await decode(request, st, DetokenizeRequest, generates=False)
    vocab = st.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid("tokens", f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})")
    return json_response({"prompt": st.tokenizer.decode(req.tokens, skip_special_tokens=False)})
