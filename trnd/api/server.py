"""The OpenAI-compatible HTTP front: starlette routes over an EngineLoop.

One API request with `n` choices becomes `n` engine requests (rids `{id}-{i}`, or `{id}` when n = 1)
whose StepOutputs are merged into one reply or one SSE stream. Every engine request lives inside an
async generator from `EngineLoop.generate`, whose `finally` aborts it; this module makes sure that
generator is always closed: when the reply is done, when a sibling choice fails, and when the client
disconnects (a watcher task waits for `http.disconnect`, for streamed and non-streamed replies alike,
so a client that leaves mid-prefill stops costing compute at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import jinja2
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd.api import protocol as P
from trnd.api.app import AppState, admin_routes, make_app
from trnd.api.chat import ChatPlan, ChoiceText, chat_grammar_found, plan_chat
from trnd.api.errors import from_decode_error
from trnd.api.fields import check_vocabulary, shown
from trnd.api.params import chat_messages, check_completion_prompt, to_sampling_params
from trnd.api.stream import EventStream, merge, sse, until_disconnect
from trnd.api.structured import GrammarLimits, compile_grammar, find_grammar
from trnd.config import ServeConfig
from trnd.engine.engine import LengthError
from trnd.engine.loop import DeadlineExceeded, EngineLoop, QueueFull, Unavailable
from trnd.engine.output import StepOutput, TokenLogprob
from trnd.model.size import model_size
from trnd.http.app import json_response, read_body, state_of
from trnd.http.errors import APIError, error_bytes
from trnd.http.session import kept_session
from trnd.http.tenant import bearer, tenant_salt
from trnd.sampling_params import SamplingParams

log = logging.getLogger("trnd.api")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
MIN_LOGPROB = -9999.0  # JSON has no -inf (a banned token's logprob); vLLM reports this instead
INLINE_TOKENIZE_CHARS = 16384  # longer texts are tokenized on a worker thread, off the event loop
LOGGED_CHARS = 128  # a client's session_id / user as the request's log line shows them (cut beyond)


def build_app(loop: EngineLoop, cfg: ServeConfig, model_name: str,
              state_extra: Callable[[], dict] | None = None) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        *admin_routes(),
    ]
    return make_app(routes, loop, cfg, model_name, state_extra, ready_hold_s=cfg.http.ready_hold_s)


# -- request intake ---------------------------------------------------------------------------------

async def _decode(request: Request, st: AppState, typ: type):
    st.refuse_if_draining()
    body = await read_body(request, st.cfg.http.max_body_bytes)
    await st.wait_serving()
    try:
        req = msgspec.json.decode(body, type=typ)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except RecursionError:  # msgspec's nesting limit
        raise APIError(400, "The request body is nested too deeply", code="invalid_json") from None
    if req.model is not None and req.model != st.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist (this server serves `{st.model_name}`)",
                       param="model", code="model_not_found")
    return req


BODY_TYPES = {"/v1/chat/completions": P.ChatCompletionRequest, "/v1/completions": P.CompletionRequest}


def check_body(path: str, body: bytes) -> None:
    """This server's body validation alone, as an APIError 400 naming the field: the router runs it before
    it reads a body of its own (roles/router.py gives it the router), so a body of the wrong shape is the
    same 400 there as here."""
    try:
        msgspec.json.decode(body, type=BODY_TYPES[path])
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except RecursionError:  # msgspec's nesting limit
        raise APIError(400, "The request body is nested too deeply", code="invalid_json") from None


async def _encode(st: AppState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return st.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(st.tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def chat_completions(request: Request) -> Response:
    arrival, st = time.monotonic(), state_of(request)
    req: P.ChatCompletionRequest = await _decode(request, st, P.ChatCompletionRequest)
    params, n = to_sampling_params(req, st.cfg.api.max_n, st.cfg.api.max_stop, st.cfg.api.max_stop_chars,
                                   st.cfg.api.max_logit_bias, st.cfg.api.max_stop_token_ids)
    params.cache_salt, params.prefill_hint = salt_of(req, request, st), prefill_hint(request)
    messages = chat_messages(req)
    limits = GrammarLimits.of(st.cfg.api)
    plan = plan_chat(req, st.cfg.api.tool_call_parser, st.cfg.api.reasoning_parser, limits)
    try:
        prompt = st.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **plan.template_kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as e:  # "roles must alternate", no template at all...
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    params.grammar = await compile_grammar(st.loop.engine, chat_grammar_found(req, plan, prompt, limits), limits)
    # The template already wrote every special token (BOS included); encoding must not add another.
    ids = await _encode(st, prompt, add_special_tokens=False)
    job = Job(st, "chat", ids, params, n, session_of(req, request), bool(req.stream),
              bool(req.stream_options and req.stream_options.include_usage), "messages", arrival,
              plan=plan, user=req.user or req.safety_identifier)
    return await job.respond(request)


def salt_of(req, request: Request, st: AppState) -> str | None:
    """The tenant's cache salt (http/tenant.py): the key this request was accepted with, where the server
    has one, and the body's cache_salt."""
    keyed = st.auth is not None and st.auth.expected is not None
    return tenant_salt(bearer(request.headers) if keyed else None, req.cache_salt)


def prefill_hint(request: Request) -> str | None:
    """The prefill peer a router found holding this prompt's prefix (x-trnd-prefill; a decode server only)."""
    hint = request.headers.get("x-trnd-prefill")
    return hint[:256] if hint else None


def session_of(req, request: Request) -> str | None:
    """The body's session_id (or OpenAI's prompt_cache_key), else the x-session-id header the router forwards
    (and that clients of the router may send instead of a body field)."""
    return req.session_id or req.prompt_cache_key or request.headers.get("x-session-id") or None


async def completions(request: Request) -> Response:
    arrival, st = time.monotonic(), state_of(request)
    req: P.CompletionRequest = await _decode(request, st, P.CompletionRequest)
    params, n = to_sampling_params(req, st.cfg.api.max_n, st.cfg.api.max_stop, st.cfg.api.max_stop_chars,
                                   st.cfg.api.max_logit_bias, st.cfg.api.max_stop_token_ids)
    params.cache_salt, params.prefill_hint = salt_of(req, request, st), prefill_hint(request)
    prompt = check_completion_prompt(req.prompt)
    limits = GrammarLimits.of(st.cfg.api)
    params.grammar = await compile_grammar(st.loop.engine, find_grammar(req, limits=limits), limits)
    ids = await _encode(st, prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
    job = Job(st, "completion", ids, params, n, session_of(req, request), bool(req.stream),
              bool(req.stream_options and req.stream_options.include_usage), "prompt", arrival,
              user=req.user or req.safety_identifier)
    return await job.respond(request)


def _translate(e: BaseException, prompt_param: str, num_prompt: int, max_model_len: int) -> APIError | None:
    if isinstance(e, APIError):
        return e
    if isinstance(e, LengthError):
        param = prompt_param if num_prompt >= max_model_len else "max_tokens"
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, QueueFull):
        return APIError(503, f"The server is overloaded ({e}); retry later", code="overloaded",
                        headers={"Retry-After": "1"})
    if isinstance(e, DeadlineExceeded):
        return APIError(504, f"The request timed out: {e}", type="server_error", code="timeout")
    if isinstance(e, Unavailable):
        return APIError(503, f"The server cannot serve this request now: {e}", code="unavailable",
                        headers={"Retry-After": "2"})
    return None


# -- one API request: n engine requests -------------------------------------------------------------

class Job:
    def __init__(self, st: AppState, kind: str, ids: list[int], params: SamplingParams, n: int,
                 session_id: str | None, stream: bool, include_usage: bool, prompt_param: str, arrival: float,
                 plan: ChatPlan | None = None, user: str | None = None):
        self.st, self.kind, self.ids, self.n = st, kind, ids, n
        self.plan = plan or ChatPlan()
        self.session_id, self.stream, self.include_usage = session_id, stream, include_usage
        # what the request's trace, /admin/state and trnd top call its session: a long id (or user) as its 32-char
        # hash (http/session.py), never kept as sent in the ring of recent traces (512 x 1 MB ids were +515 MB)
        self.session = kept_session(session_id or user)
        self.prompt_param = prompt_param
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.rids = [self.id] if n == 1 else [f"{self.id}-{i}" for i in range(n)]
        engine = st.loop.engine
        self.max_model_len = engine.max_model_len
        if not ids:
            raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{prompt_param}: token ids must be in [0, {vocab})", param=prompt_param)
        check_vocabulary(params, vocab)
        max_given = params.max_tokens != 0
        if params.max_tokens == 0:  # not given: the rest of the context (chat) or OpenAI's 16 (completions)
            left = max(1, self.max_model_len - len(ids))
            params.max_tokens = left if kind == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, left)
        try:
            engine.check_length(len(ids), params.max_tokens)
        except LengthError as e:
            raise self.translate(e) from None
        if params.min_tokens > params.max_tokens:
            raise APIError(400, f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens}"
                                f"{', what the context leaves' if not max_given else ''})", param="min_tokens")
        cap = st.cfg.api.max_job_tokens
        if cap is not None and n * (len(ids) + params.max_tokens) > cap:
            raise APIError(400, f"n x (prompt + max_tokens) = {n} x {len(ids) + params.max_tokens} tokens exceeds "
                                f"this server's limit of {cap}", param="n")
        loop = st.loop
        # The admission decision is made here, before any reply starts: the n slots are reserved now
        # (no await since the check), so a streamed reply never turns into an error after its 200.
        if not loop.reserve(self.rids):
            raise self.translate(QueueFull(f"{loop.num_requests} requests in flight (limit {loop.max_requests})"))
        self.params = [params if n == 1 or params.seed is None
                       else msgspec.structs.replace(params, seed=params.seed + i) for i in range(n)]
        self.want_logprobs = params.logprobs is not None
        self.trackers = [st.metrics.tracker(arrival) for _ in range(n)]
        log.log(logging.INFO if session_id or user else logging.DEBUG,
                "request %s: %s, %d prompt tokens, n=%d, session_id=%s, user=%s, grammar=%s", self.id, kind, len(ids),
                n, session_id and shown(session_id, LOGGED_CHARS), user and shown(user, LOGGED_CHARS),
                params.grammar.kind if params.grammar else None)

    def release(self) -> None:
        self.st.loop.unreserve(self.rids)

    def translate(self, e: BaseException) -> APIError | None:
        return _translate(e, self.prompt_param, len(self.ids), self.max_model_len)

    async def respond(self, request: Request) -> Response | EventStream:
        headers = {"X-Request-Id": self.id}
        if self.stream:
            return EventStream(self.events(), headers, on_close=self.release)
        try:
            result = await until_disconnect(request.receive, self.collect())
        finally:
            self.release()
        if result is None:  # the client left; nobody will read this
            return Response(status_code=499)
        return json_response(result, headers=headers)

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, StepOutput) of all n engine requests, as they come; registered for
        /admin/abort/{id} while running. Closing this closes (so aborts) every engine request."""
        loop = self.st.loop
        gens = [loop.generate(self.ids, p, rid, self.session) for p, rid in zip(self.params, self.rids)]
        self.st.active[self.id] = self.rids
        try:
            async with contextlib.aclosing(merge(gens)) as it:
                async for i, out in it:
                    self.trackers[i].observe(out)
                    yield i, out
        finally:
            self.st.active.pop(self.id, None)
            for t in self.trackers:
                t.gone()

    # -- non-streamed ---------------------------------------------------------------------------------

    async def collect(self) -> P.ChatCompletion | P.Completion:
        n = self.n
        texts: list[list[str]] = [[] for _ in range(n)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
        last: list[StepOutput | None] = [None] * n
        try:
            async with contextlib.aclosing(self.outputs()) as it:
                async for i, out in it:
                    texts[i].append(out.text)
                    if out.logprobs:
                        lps[i] += out.logprobs
                    last[i] = out
        except Exception as e:
            err = self.translate(e)
            if err is None:
                raise
            raise err from None
        reasons = [o.finish_reason if o is not None else "abort" for o in last]
        usage = self.usage(last)
        if self.kind == "chat":
            parsed = [ChoiceText(self.plan) for _ in range(n)]
            for i in range(n):
                parsed[i].push("".join(texts[i]), final=True)
            choices = [P.ChatChoice(i, parsed[i].message(),
                                    P.ChatLogprobs(self.chat_logprobs(lps[i])) if self.want_logprobs else None,
                                    parsed[i].finish_reason(reasons[i])) for i in range(n)]
            return P.ChatCompletion(self.id, "chat.completion", self.created, self.st.model_name, choices, usage)
        choices = [P.CompletionChoice(i, "".join(texts[i]),
                                      self.completion_logprobs(lps[i], 0) if self.want_logprobs else None,
                                      reasons[i]) for i in range(n)]
        return P.Completion(self.id, "text_completion", self.created, self.st.model_name, choices, usage)

    def usage(self, last: list[StepOutput | None]) -> P.Usage:
        """Prompt counted once (as OpenAI does for n > 1); cached tokens as seen by choice 0."""
        done = [o for o in last if o is not None]
        cached = done[0].cached_tokens if done else 0
        return P.usage(len(self.ids), sum(o.completion_tokens for o in done), cached)

    # -- streamed -------------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[bytes]:
        name, n = self.st.model_name, self.n
        last: list[StepOutput | None] = [None] * n
        offsets = [0] * n
        parsed = [ChoiceText(self.plan) for _ in range(n)]
        if self.kind == "chat":
            for i in range(n):
                yield sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name,
                                                 [P.ChatChunkChoice(i, P.Delta(role="assistant", content=""))]))
        try:
            async with contextlib.aclosing(self.outputs()) as it:
                async for i, out in it:
                    last[i] = out
                    if not (out.text or out.finished or out.logprobs):
                        continue
                    if self.kind == "chat":
                        lp = P.ChatLogprobs(self.chat_logprobs(out.logprobs or [])) if self.want_logprobs else None
                        deltas = parsed[i].push(out.text, final=out.finished)
                        if not deltas and lp is None and not out.finished:
                            continue  # held back (a tag may be starting): nothing to send yet
                        deltas = deltas or [P.Delta()]
                        for k, delta in enumerate(deltas):
                            last_one = k == len(deltas) - 1
                            choice = P.ChatChunkChoice(i, delta, lp if last_one else None,
                                                       parsed[i].finish_reason(out.finish_reason) if last_one else None)
                            yield sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name,
                                                             [choice]))
                    else:
                        lp = None
                        if self.want_logprobs:
                            lp = self.completion_logprobs(out.logprobs or [], offsets[i])
                            offsets[i] = (lp.text_offset[-1] + len(lp.tokens[-1])) if lp.tokens else offsets[i]
                        choice = P.CompletionChoice(i, out.text, lp, out.finish_reason)
                        yield sse(P.Completion(self.id, "text_completion", self.created, name, [choice]))
        except Exception as e:
            err = self.translate(e)
            if err is None:
                log.exception("request %s failed mid-stream", self.id)
                err = APIError(500, "Internal server error", type="server_error", code="internal_error")
            yield b"data: " + error_bytes(err) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        if self.include_usage:
            usage = self.usage(last)
            if self.kind == "chat":
                yield sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name, [], usage))
            else:
                yield sse(P.Completion(self.id, "text_completion", self.created, name, [], usage))
        yield b"data: [DONE]\n\n"

    # -- logprobs -------------------------------------------------------------------------------------

    def chat_logprobs(self, lps: list[TokenLogprob]) -> list[P.ChatTokenLogprob]:
        tok = self.st.token
        out = []
        for t in lps:
            top = []
            for tid, lp in t.top:
                text, raw = tok(tid)
                top.append(P.TopLogprob(text, max(lp, MIN_LOGPROB), raw))
            text, raw = tok(t.token)
            out.append(P.ChatTokenLogprob(text, max(t.logprob, MIN_LOGPROB), raw, top))
        return out

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> P.CompletionLogprobs:
        tok = self.st.token
        tokens, values, tops, offsets = [], [], [], []
        for t in lps:
            s = tok(t.token)[0]
            tokens.append(s)
            values.append(max(t.logprob, MIN_LOGPROB))
            tops.append({tok(tid)[0]: max(lp, MIN_LOGPROB) for tid, lp in t.top})
            offsets.append(offset)
            offset += len(s)
        return P.CompletionLogprobs(tokens, values, tops, offsets)


# -- models, probes, metrics ------------------------------------------------------------------------

async def models(request: Request) -> Response:
    st = state_of(request)
    await st.wait_serving()
    engine = st.loop.engine
    extra = st.state_extra() if st.state_extra is not None else {}
    cap = extra.get("capacity")
    card = P.ModelCard(st.model_name, "model", int(st.started), "trnd", engine.max_model_len, extra.get("point"),
                       msgspec.structs.asdict(cap) if cap is not None else None, True if engine.cfg.static else None,
                       msgspec.structs.asdict(model_size(engine.cfg.model)))
    return json_response(P.ModelList("list", [card]))
