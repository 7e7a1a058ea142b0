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
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field

import jinja2
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from trnd.api import protocol as P
from trnd.api.auth import APIKeyMiddleware
from trnd.api.errors import (APIError, api_error_handler, error_bytes, from_decode_error, http_error_handler,
                             internal_error_handler)
from trnd.api.metrics import Metrics
from trnd.config import ServeConfig
from trnd.engine.engine import LengthError
from trnd.engine.loop import EngineLoop, QueueFull, Unavailable
from trnd.engine.output import StepOutput, TokenLogprob
from trnd.engine.request import SamplingParams

log = logging.getLogger("trnd.api")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
HEALTH_STALL_S = 30.0  # /health fails when the engine loop has not come round for this long
LOOP_TIMEOUT_S = 5.0  # how long admin calls wait for the engine loop
MIN_LOGPROB = -9999.0  # JSON has no -inf (a banned token's logprob); vLLM reports this instead
INLINE_TOKENIZE_CHARS = 16384  # longer texts are tokenized on a worker thread, off the event loop
READY_HOLD_S = 30.0  # an OpenAI request that arrives before the server can serve it waits this long, then 503


@dataclass
class AppState:
    """`app.state.trnd`: what the handlers share. The lead may flip `draining` / `ready` at any time."""
    loop: EngineLoop
    cfg: ServeConfig
    model_name: str
    metrics: Metrics
    state_extra: Callable[[], dict] | None = None
    draining: bool = False
    ready: bool = True
    ready_fn: Callable[[], bool] | None = None  # a role's own readiness (decode: a prefill peer handshaked)
    not_ready_why: Callable[[], str] | None = None  # what it waits for, for the 503's message
    ready_hold_s: float = READY_HOLD_S
    health_stall_s: float = HEALTH_STALL_S
    started: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    active: dict[str, list[str]] = field(default_factory=dict)  # API request id -> engine rids
    _tokens: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.loop.engine.tokenizer

    @property
    def serving(self) -> bool:
        """A request sent now is served: warmed up, and the role's own readiness holds."""
        return self.ready and self.loop.error is None and (self.ready_fn is None or self.ready_fn())

    async def wait_serving(self) -> None:
        """Ready means ready: the OpenAI routes (/v1/models too, which clients poll to learn that the
        server is up) hold a request until the server can serve it, for at most ready_hold_s, then
        answer 503 with Retry-After. Covers start-up (warm-up, the decode role's first prefill peer)
        and a decode server whose every prefill peer is lost while the supervisor restarts one."""
        deadline = time.monotonic() + self.ready_hold_s
        while not self.serving:
            if self.draining:
                raise APIError(503, "The server is draining and accepts no new requests", code="draining",
                               headers={"Retry-After": "1"})
            if time.monotonic() >= deadline:
                why = self.not_ready_why() if self.not_ready_why is not None else "starting"
                raise APIError(503, f"The server is not ready to serve yet ({why}); retry later",
                               code="not_ready", headers={"Retry-After": "2"})
            await asyncio.sleep(0.05)

    def token(self, tid: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token for logprobs, cached: the vocabulary is fixed."""
        t = self._tokens.get(tid)
        if t is None:
            t = self._tokens[tid] = _token_text_bytes(self.tokenizer, tid)
        return t


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte -> printable-char map, inverted: byte-level BPE vocab entries spell raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_table()


def _token_text_bytes(tokenizer, tid: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([tid], skip_special_tokens=False)
    if "\ufffd" in text:  # part of a multi-byte character: the raw bytes say which part
        piece = tokenizer.id_to_token(tid) or ""
        if piece and all(ch in _BYTE_LEVEL for ch in piece):
            return text, [_BYTE_LEVEL[ch] for ch in piece]
    return text, list(text.encode("utf-8", errors="replace"))


def build_app(loop: EngineLoop, cfg: ServeConfig, model_name: str,
              state_extra: Callable[[], dict] | None = None) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/state", admin_state, methods=["GET"]),
        Route("/admin/abort/{rid}", admin_abort, methods=["POST"]),
        Route("/admin/drain", admin_drain, methods=["POST"]),
        Route("/admin/evict", admin_evict, methods=["POST"]),
    ]
    return _app(routes, loop, cfg, model_name, state_extra)


def build_admin_app(loop: EngineLoop, cfg: ServeConfig, model_name: str,
                    state_extra: Callable[[], dict] | None = None) -> Starlette:
    """Probes, metrics and admin only: for roles with no OpenAI front (prefill)."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/state", admin_state, methods=["GET"]),
        Route("/admin/evict", admin_evict, methods=["POST"]),
    ]
    return _app(routes, loop, cfg, model_name, state_extra)


def _app(routes, loop, cfg, model_name, state_extra) -> Starlette:
    app = Starlette(routes=routes,
                    middleware=[Middleware(APIKeyMiddleware, api_key=cfg.resolved_api_key())],
                    exception_handlers={APIError: api_error_handler, HTTPException: http_error_handler,
                                        Exception: internal_error_handler})
    app.state.trnd = AppState(loop, cfg, model_name, Metrics(model_name), state_extra, ready_hold_s=cfg.ready_hold_s)
    return app


def _state(request: Request) -> AppState:
    return request.app.state.trnd


def _json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


# -- request intake ---------------------------------------------------------------------------------

async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes whether announced (Content-Length) or not (chunked)."""
    too_big = APIError(413, f"Request body is larger than the limit of {limit} bytes", code="request_too_large")
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isdigit():
            raise APIError(400, "Invalid Content-Length header")
        if int(cl) > limit:
            raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: nobody reads the answer, but it must not be a 500
        raise APIError(400, "Client disconnected while sending the body") from None
    return b"".join(chunks)


async def _decode(request: Request, st: AppState, typ: type):
    if st.draining:
        raise APIError(503, "The server is draining and accepts no new requests", code="draining",
                       headers={"Retry-After": "1"})
    body = await read_body(request, st.cfg.max_body_bytes)
    await st.wait_serving()
    try:
        req = msgspec.json.decode(body, type=typ)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    if req.model is not None and req.model != st.model_name:
        raise APIError(404, f"The model `{req.model}` does not exist (this server serves `{st.model_name}`)",
                       param="model", code="model_not_found")
    return req


async def _encode(st: AppState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return st.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(st.tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def chat_completions(request: Request) -> Response:
    arrival, st = time.monotonic(), _state(request)
    req: P.ChatCompletionRequest = await _decode(request, st, P.ChatCompletionRequest)
    params, n = P.to_sampling_params(req, st.cfg.max_n)
    messages = P.chat_messages(req)
    try:
        prompt = st.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (jinja2.TemplateError, ValueError) as e:  # e.g. "roles must alternate", or no template at all
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    # The template already wrote every special token (BOS included); encoding must not add another.
    ids = await _encode(st, prompt, add_special_tokens=False)
    job = Job(st, "chat", ids, params, n, req.session_id, bool(req.stream),
              bool(req.stream_options and req.stream_options.include_usage), "messages", arrival)
    return await job.respond(request)


async def completions(request: Request) -> Response:
    arrival, st = time.monotonic(), _state(request)
    req: P.CompletionRequest = await _decode(request, st, P.CompletionRequest)
    params, n = P.to_sampling_params(req, st.cfg.max_n)
    prompt = P.check_completion_prompt(req.prompt)
    ids = await _encode(st, prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
    job = Job(st, "completion", ids, params, n, req.session_id, bool(req.stream),
              bool(req.stream_options and req.stream_options.include_usage), "prompt", arrival)
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
    if isinstance(e, Unavailable):
        return APIError(503, f"The server cannot serve this request now: {e}", code="unavailable",
                        headers={"Retry-After": "2"})
    return None


# -- one API request: n engine requests -------------------------------------------------------------

class Job:
    def __init__(self, st: AppState, kind: str, ids: list[int], params: SamplingParams, n: int,
                 session_id: str | None, stream: bool, include_usage: bool, prompt_param: str, arrival: float):
        self.st, self.kind, self.ids, self.n = st, kind, ids, n
        self.session_id, self.stream, self.include_usage = session_id, stream, include_usage
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
        if params.max_tokens == 0:  # not given: the rest of the context (chat) or OpenAI's 16 (completions)
            left = max(1, self.max_model_len - len(ids))
            params.max_tokens = left if kind == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, left)
        try:
            engine.check_length(len(ids), params.max_tokens)
        except LengthError as e:
            raise self.translate(e) from None
        loop = st.loop
        if loop.num_requests + n > loop.max_requests:
            raise self.translate(QueueFull(f"{loop.num_requests} requests in flight (limit {loop.max_requests})"))
        self.params = [params if n == 1 or params.seed is None
                       else msgspec.structs.replace(params, seed=params.seed + i) for i in range(n)]
        self.want_logprobs = params.logprobs is not None
        self.trackers = [st.metrics.tracker(arrival) for _ in range(n)]

    def translate(self, e: BaseException) -> APIError | None:
        return _translate(e, self.prompt_param, len(self.ids), self.max_model_len)

    async def respond(self, request: Request) -> Response | EventStream:
        headers = {"X-Request-Id": self.id}
        if self.stream:
            return EventStream(self.events(), headers)
        result = await until_disconnect(request.receive, self.collect())
        if result is None:  # the client left; nobody will read this
            return Response(status_code=499)
        return _json(result, headers=headers)

    async def outputs(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, StepOutput) of all n engine requests, as they come; registered for
        /admin/abort/{id} while running. Closing this closes (so aborts) every engine request."""
        loop = self.st.loop
        gens = [loop.generate(self.ids, p, rid, self.session_id) for p, rid in zip(self.params, self.rids)]
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
            choices = [P.ChatChoice(i, P.ChatMessageOut("assistant", "".join(texts[i])),
                                    P.ChatLogprobs(self.chat_logprobs(lps[i])) if self.want_logprobs else None,
                                    reasons[i]) for i in range(n)]
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
        if self.kind == "chat":
            for i in range(n):
                yield _sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name,
                                                 [P.ChatChunkChoice(i, P.Delta(role="assistant", content=""))]))
        try:
            async with contextlib.aclosing(self.outputs()) as it:
                async for i, out in it:
                    last[i] = out
                    if not (out.text or out.finished or out.logprobs):
                        continue
                    if self.kind == "chat":
                        lp = P.ChatLogprobs(self.chat_logprobs(out.logprobs or [])) if self.want_logprobs else None
                        choice = P.ChatChunkChoice(i, P.Delta(content=out.text or None), lp, out.finish_reason)
                        yield _sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name,
                                                         [choice]))
                    else:
                        lp = None
                        if self.want_logprobs:
                            lp = self.completion_logprobs(out.logprobs or [], offsets[i])
                            offsets[i] = (lp.text_offset[-1] + len(lp.tokens[-1])) if lp.tokens else offsets[i]
                        choice = P.CompletionChoice(i, out.text, lp, out.finish_reason)
                        yield _sse(P.Completion(self.id, "text_completion", self.created, name, [choice]))
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
                yield _sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name, [], usage))
            else:
                yield _sse(P.Completion(self.id, "text_completion", self.created, name, [], usage))
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


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def merge(gens: list[AsyncIterator[StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleave several engine streams. The first failure ends the merge; closing the merge (or
    failing) closes every stream, which aborts their engine requests."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, coro: Coroutine):
    """Run coro unless the client disconnects first (then cancel it and return None)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return None
    finally:
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


class EventStream:
    """A server-sent-events reply that stops (and closes its event source, aborting the engine
    requests) the moment the client disconnects, even while no event is due (a long prefill)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        self.events = events
        self.status_code = 200
        h = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
             "x-accel-buffering": "no", **{k.lower(): v for k, v in (headers or {}).items()}}
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # a server that reports a gone client by failing send (ASGI spec 2.4)
                pass

        try:
            await until_disconnect(receive, pump())
        finally:
            await self.events.aclose()


# -- models, probes, metrics ------------------------------------------------------------------------

async def models(request: Request) -> Response:
    st = _state(request)
    await st.wait_serving()
    card = P.ModelCard(st.model_name, "model", int(st.started), "trnd", st.loop.engine.max_model_len)
    return _json(P.ModelList("list", [card]))


async def health(request: Request) -> Response:
    st = _state(request)
    loop = st.loop
    since = time.monotonic() - loop.last_progress
    body = {"status": "ok", "last_progress_s": round(since, 3)}
    if loop.error is not None:
        body.update(status="error", error=f"engine loop crashed: {type(loop.error).__name__}: {loop.error}")
    elif since > st.health_stall_s:
        body.update(status="stalled")
    return _json(body, 200 if body["status"] == "ok" else 503)


async def ready(request: Request) -> Response:
    st = _state(request)
    if st.loop.error is not None:
        return _json({"status": "error"}, 503)
    if st.draining:
        return _json({"status": "draining"}, 503)
    if not st.serving:
        return _json({"status": "loading"}, 503)
    return _json({"status": "ready"})


async def metrics(request: Request) -> Response:
    st = _state(request)
    return Response(await st.metrics.render(st.loop), media_type=CONTENT_TYPE_LATEST)


# -- admin ------------------------------------------------------------------------------------------

async def _on_loop(st: AppState, fn: Callable[[], object]):
    if st.loop.error is not None:
        raise APIError(503, "The engine loop has crashed", code="engine_error")
    try:
        return await asyncio.wait_for(st.loop.run_on_loop(fn), LOOP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"The engine loop did not answer within {LOOP_TIMEOUT_S} s", code="engine_busy") from None


async def admin_state(request: Request) -> Response:
    st = _state(request)
    state = await _on_loop(st, st.loop.engine.state)
    state.update(model=st.model_name, role="serve", uptime_s=round(time.monotonic() - st.started_mono, 3),
                 draining=st.draining)
    if st.state_extra is not None:
        state.update(st.state_extra())
    return _json(state)


async def admin_abort(request: Request) -> Response:
    """Abort an API request (all its choices) by the id in its reply, or one engine request by rid."""
    st = _state(request)
    rid = request.path_params["rid"]
    rids = list(st.active.get(rid, [rid]))
    futures = [asyncio.wrap_future(st.loop.abort(r)) for r in rids]
    try:
        results = await asyncio.wait_for(asyncio.gather(*futures), LOOP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"The engine loop did not answer within {LOOP_TIMEOUT_S} s", code="engine_busy") from None
    aborted = [r for r, ok in zip(rids, results) if ok]
    if not aborted:
        raise APIError(404, f"No running request with id {rid!r}", param="rid", code="request_not_found")
    return _json({"aborted": aborted})


async def admin_drain(request: Request) -> Response:
    st = _state(request)
    st.draining = True
    return _json({"draining": True, "in_flight": st.loop.num_requests})


async def admin_evict(request: Request) -> Response:
    st = _state(request)
    freed = await _on_loop(st, st.loop.engine.radix.reset)
    return _json({"evicted_pages": freed})
