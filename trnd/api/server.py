"""The OpenAI-compatible HTTP front: starlette routes over an EngineLoop. A chat or completions request
becomes a Job (api/job.py): its prompts' engine requests, merged into one reply or one SSE stream."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd import __version__
from trnd.api import protocol as P
from trnd.api import responses, tokens
from trnd.api.app import admin_routes, make_app
from trnd.api.chat import chat_grammar_found, plan_chat, render_chat
from trnd.api.intake import check_body, decode, encode, prefill_hint, salt_of, session_of  # noqa: F401 (check_body: roles/router.py)
from trnd.api.job import Job
from trnd.api.params import chat_messages, completion_prompts, to_sampling_params, truncate
from trnd.api.structured import GrammarLimits, compile_grammar, find_grammar
from trnd.config import ServeConfig
from trnd.engine.loop import EngineLoop
from trnd.model.size import model_size
from trnd.http.app import json_response, state_of
from trnd.http.errors import APIError


def build_app(loop: EngineLoop, cfg: ServeConfig, model_name: str,
              state_extra: Callable[[], dict] | None = None) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *responses.routes(),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        *tokens.routes(),
        Route("/version", version, methods=["GET"]),
        *admin_routes(),
    ]
    app = make_app(routes, loop, cfg, model_name, state_extra, ready_hold_s=cfg.http.ready_hold_s)
    responses.attach(app, cfg)
    return app


async def chat_completions(request: Request) -> Response:
    arrival, st = time.monotonic(), state_of(request)
    req: P.ChatCompletionRequest = await decode(request, st, P.ChatCompletionRequest)
    params, n = to_sampling_params(req, st.cfg.api.max_n, st.cfg.api.max_stop, st.cfg.api.max_stop_chars,
                                   st.cfg.api.max_logit_bias, st.cfg.api.max_stop_token_ids)
    params.cache_salt, params.prefill_hint = salt_of(req, request, st), prefill_hint(request)
    messages = chat_messages(req)
    limits = GrammarLimits.of(st.cfg.api)
    plan = plan_chat(req, st.cfg.api.tool_call_parser, st.cfg.api.reasoning_parser, limits)
    prompt, echo = render_chat(req, st.tokenizer, messages, plan)
    params.grammar = await compile_grammar(st.loop.engine, chat_grammar_found(req, plan, prompt, limits), limits)
    # The template already wrote every special token (BOS included): encoding adds none unless asked.
    ids = truncate(await encode(st, prompt, bool(req.add_special_tokens)), req, st.loop.engine.max_model_len)
    job = Job(st, "chat", [ids], params, n, session_id=session_of(req, request), stream=bool(req.stream),
              include_usage=bool(req.stream_options and req.stream_options.include_usage), prompt_param="messages",
              arrival=arrival, plan=plan, user=req.user or req.safety_identifier, echo=[echo] if echo else None,
              request_id=req.request_id or req.rid, tokens_as_ids=bool(req.return_tokens_as_token_ids))
    return await job.respond(request)


async def completions(request: Request) -> Response:
    arrival, st = time.monotonic(), state_of(request)
    req: P.CompletionRequest = await decode(request, st, P.CompletionRequest)
    params, n = to_sampling_params(req, st.cfg.api.max_n, st.cfg.api.max_stop, st.cfg.api.max_stop_chars,
                                   st.cfg.api.max_logit_bias, st.cfg.api.max_stop_token_ids)
    params.cache_salt, params.prefill_hint = salt_of(req, request, st), prefill_hint(request)
    prompts = completion_prompts(req.prompt)
    limits = GrammarLimits.of(st.cfg.api)
    params.grammar = await compile_grammar(st.loop.engine, find_grammar(req, limits=limits), limits)
    add_special = req.add_special_tokens is not False
    ids = [truncate(await encode(st, p, add_special) if isinstance(p, str) else p, req, st.loop.engine.max_model_len)
           for p in prompts]
    echo = [p if isinstance(p, str) else st.tokenizer.decode(p, skip_special_tokens=False) for p in prompts] \
        if req.echo else None
    job = Job(st, "completion", ids, params, n, session_id=session_of(req, request), stream=bool(req.stream),
              include_usage=bool(req.stream_options and req.stream_options.include_usage), prompt_param="prompt",
              arrival=arrival, user=req.user or req.safety_identifier, echo=echo,
              request_id=req.request_id or req.rid, tokens_as_ids=bool(req.return_tokens_as_token_ids))
    return await job.respond(request)


# -- models, probes, metrics ------------------------------------------------------------------------

def model_card(st) -> P.ModelCard:
    engine = st.loop.engine
    extra = st.state_extra() if st.state_extra is not None else {}
    cap = extra.get("capacity")
    return P.ModelCard(st.model_name, "model", int(st.started), "trnd", engine.max_model_len, extra.get("point"),
                       msgspec.structs.asdict(cap) if cap is not None else None, True if engine.cfg.static else None,
                       msgspec.structs.asdict(model_size(engine.cfg.model)))


async def models(request: Request) -> Response:
    st = state_of(request)
    await st.wait_serving()
    return json_response(P.ModelList("list", [model_card(st)]))


async def model(request: Request) -> Response:
    """GET /v1/models/{id}: the card of the served model, 404 model_not_found for any other id."""
    st = state_of(request)
    name = request.path_params["model"]
    if name != st.model_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves `{st.model_name}`)",
                       param="model", code="model_not_found")
    await st.wait_serving()
    return json_response(model_card(st))


async def version(request: Request) -> Response:
    return json_response({"version": __version__})
