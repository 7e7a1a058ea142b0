"""One API request as engine requests: `len(prompts) x n` of them (choice i is prompt i // n, sample
i % n; rids `{id}-{i}`, or `{id}` for one), whose StepOutputs are merged into one reply or one SSE stream.

Every engine request lives inside an async generator from `EngineLoop.generate`, whose `finally` aborts
it; this module makes sure that generator is always closed: when the reply is done, when a sibling choice
fails, and when the client disconnects (a watcher task waits for `http.disconnect`, for streamed and
non-streamed replies alike, so a client that leaves mid-prefill stops costing compute at once).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from trnd.api import protocol as P
from trnd.api.app import AppState
from trnd.api.chat import ChatPlan, ChoiceText
from trnd.api.fields import check_vocabulary, shown
from trnd.api.stream import EventStream, merge, sse, until_disconnect
from trnd.engine.engine import LengthError
from trnd.engine.loop import DeadlineExceeded, QueueFull, Unavailable
from trnd.engine.output import StepOutput, TokenLogprob
from trnd.http.app import json_response
from trnd.http.session import kept_session
from trnd.http.errors import APIError, error_bytes
from trnd.sampling_params import SamplingParams

log = logging.getLogger("trnd.api")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
MIN_LOGPROB = -9999.0  # JSON has no -inf (a banned token's logprob); vLLM reports this instead
LOGGED_CHARS = 128  # a client's session_id / user as the request's log line shows them (cut beyond)


def translate(e: BaseException, prompt_param: str, num_prompt: int, max_model_len: int) -> APIError | None:
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


class Job:
    def __init__(self, st: AppState, kind: str, prompts: list[list[int]], params: SamplingParams, n: int, *,
                 session_id: str | None, stream: bool, include_usage: bool, prompt_param: str, arrival: float,
                 plan: ChatPlan | None = None, user: str | None = None, echo: list[str] | None = None,
                 request_id: str | None = None, tokens_as_ids: bool = False,
                 job_id: str | None = None):
        self.st, self.kind, self.prompts, self.n = st, kind, prompts, n
        self.total = len(prompts) * n
        self.plan = plan or ChatPlan()
        self.session_id, self.stream, self.include_usage = session_id, stream, include_usage
        # what the request's trace, /admin/state and trnd top call its session: a long id (or user) as its 32-char
        # hash (http/session.py), never kept as sent in the ring of recent traces (512 x 1 MB ids were +515 MB)
        self.session = kept_session(session_id or user)
        self.prompt_param, self.echo, self.tokens_as_ids = prompt_param, echo, tokens_as_ids
        self.id = job_id or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.rids = [self.id] if self.total == 1 else [f"{self.id}-{i}" for i in range(self.total)]
        engine, loop = st.loop.engine, st.loop
        self.max_model_len = engine.max_model_len
        per_prompt = [self._check(k, ids, params) for k, ids in enumerate(prompts)]
        cap = st.cfg.api.max_job_tokens
        asked = sum(n * (len(ids) + p.max_tokens) for ids, p in zip(prompts, per_prompt))
        if cap is not None and asked > cap:
            raise APIError(400, f"n x (prompt + max_tokens) = {asked} tokens exceeds this server's limit of {cap}",
                           param="n")
        if self.total > loop.max_requests:
            raise APIError(400, f"{len(prompts)} prompts x n = {n} is {self.total} requests; this server runs at "
                                f"most {loop.max_requests} at once", param=prompt_param if len(prompts) > 1 else "n")
        if self.id in st.active:
            raise APIError(409, f"request_id {request_id!r} is already in use by a request in flight",
                           param="request_id", code="duplicate_request_id")
        # The admission decision is made here, before any reply starts: the slots are reserved now
        # (no await since the check), so a streamed reply never turns into an error after its 200.
        if not loop.reserve(self.rids):
            raise self.translate(QueueFull(f"{loop.num_requests} requests in flight (limit {loop.max_requests})"))
        st.active[self.id] = self.rids  # /admin/abort/{id}; request ids in flight are unique
        self.params = [per_prompt[i // n] if n == 1 or params.seed is None
                       else msgspec.structs.replace(per_prompt[i // n], seed=params.seed + i % n)
                       for i in range(self.total)]
        self.want_logprobs = params.logprobs is not None
        self.trackers = [st.metrics.tracker(arrival) for _ in range(self.total)]
        log.log(logging.INFO if session_id or user else logging.DEBUG,
                "request %s: %s, %d prompt tokens%s, n=%d, session_id=%s, user=%s, grammar=%s", self.id, kind,
                sum(map(len, prompts)), f" in {len(prompts)} prompts" if len(prompts) > 1 else "", n,
                session_id and shown(session_id, LOGGED_CHARS), user and shown(user, LOGGED_CHARS),
                params.grammar.kind if params.grammar else None)

    def _check(self, k: int, ids: list[int], params: SamplingParams) -> SamplingParams:
        """One prompt's checks, and its params with max_tokens resolved (0: not given)."""
        where = self.prompt_param if len(self.prompts) == 1 else f"{self.prompt_param}[{k}]"
        if not ids:
            raise APIError(400, f"{where}: the prompt is empty", param=self.prompt_param)
        vocab = self.st.loop.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{where}: token ids must be in [0, {vocab})", param=self.prompt_param)
        check_vocabulary(params, vocab)
        max_given = params.max_tokens != 0
        if not max_given:  # the rest of the context (chat) or OpenAI's 16 (completions)
            left = max(1, self.max_model_len - len(ids))
            params = msgspec.structs.replace(
                params, max_tokens=left if self.kind == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, left))
        try:
            self.st.loop.engine.check_length(len(ids), params.max_tokens)
        except LengthError as e:
            raise translate(e, self.prompt_param, len(ids), self.max_model_len) from None
        if params.min_tokens > params.max_tokens:
            raise APIError(400, f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens}"
                                f"{', what the context leaves' if not max_given else ''})", param="min_tokens")
        return params

    def release(self) -> None:
        self.st.loop.unreserve(self.rids)
        if self.st.active.get(self.id) is self.rids:
            del self.st.active[self.id]

    def translate(self, e: BaseException) -> APIError | None:
        return translate(e, self.prompt_param, max(map(len, self.prompts)), self.max_model_len)

    def echoed(self, i: int) -> str:
        return self.echo[i // self.n] if self.echo else ""

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
        """(choice index, StepOutput) of every engine request, as they come. Closing this closes (so aborts)
        every engine request."""
        loop = self.st.loop
        gens = [loop.generate(self.prompts[i // self.n], p, rid, self.session)
                for i, (p, rid) in enumerate(zip(self.params, self.rids))]
        try:
            async with contextlib.aclosing(merge(gens)) as it:
                async for i, out in it:
                    self.trackers[i].observe(out)
                    yield i, out
        finally:
            for t in self.trackers:
                t.gone()

    async def gather(self) -> tuple[list[str], list[list[TokenLogprob]], list[StepOutput | None]]:
        """Every choice whole: its text, logprobs and last StepOutput (None: it never produced one)."""
        texts: list[list[str]] = [[] for _ in range(self.total)]
        lps: list[list[TokenLogprob]] = [[] for _ in range(self.total)]
        last: list[StepOutput | None] = [None] * self.total
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
        return ["".join(t) for t in texts], lps, last

    # -- non-streamed ---------------------------------------------------------------------------------

    async def collect(self) -> P.ChatCompletion | P.Completion:
        texts, lps, last = await self.gather()
        reasons = [o.finish_reason if o is not None else "abort" for o in last]
        usage = self.usage(last)
        if self.kind == "chat":
            choices = []
            for i, text in enumerate(texts):
                parsed = ChoiceText(self.plan)
                parsed.push(text, final=True)
                message = parsed.message()
                if self.echoed(i):
                    message.content = self.echoed(i) + (message.content or "")
                choices.append(P.ChatChoice(i, message, P.ChatLogprobs(self.chat_logprobs(lps[i]))
                                            if self.want_logprobs else None, parsed.finish_reason(reasons[i])))
            return P.ChatCompletion(self.id, "chat.completion", self.created, self.st.model_name, choices, usage)
        choices = [P.CompletionChoice(i, self.echoed(i) + text,
                                      self.completion_logprobs(lps[i], 0) if self.want_logprobs else None,
                                      reasons[i]) for i, text in enumerate(texts)]
        return P.Completion(self.id, "text_completion", self.created, self.st.model_name, choices, usage)

    def usage(self, last: list[StepOutput | None]) -> P.Usage:
        """Each prompt counted once (as OpenAI does for n > 1); cached tokens as seen by choice 0."""
        done = [o for o in last if o is not None]
        cached = done[0].cached_tokens if done else 0
        return P.usage(sum(map(len, self.prompts)), sum(o.completion_tokens for o in done), cached)

    # -- streamed -------------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[bytes]:
        name, total = self.st.model_name, self.total
        last: list[StepOutput | None] = [None] * total
        offsets = [0] * total
        parsed = [ChoiceText(self.plan) for _ in range(total)]
        for i in range(total):
            if self.kind == "chat":
                yield sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name,
                                                 [P.ChatChunkChoice(i, P.Delta(role="assistant", content=""))]))
                if self.echoed(i):
                    yield sse(P.ChatCompletionChunk(self.id, "chat.completion.chunk", self.created, name,
                                                     [P.ChatChunkChoice(i, P.Delta(content=self.echoed(i)))]))
            elif self.echoed(i):
                yield sse(P.Completion(self.id, "text_completion", self.created, name,
                                       [P.CompletionChoice(i, self.echoed(i), None, None)]))
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

    def token(self, tid: int) -> tuple[str, list[int]]:
        """A logprob entry's token: its text and bytes, or "token_id:{id}" (return_tokens_as_token_ids)."""
        if self.tokens_as_ids:
            text = f"token_id:{tid}"
            return text, list(text.encode())
        return self.st.token(tid)

    def chat_logprobs(self, lps: list[TokenLogprob]) -> list[P.ChatTokenLogprob]:
        tok = self.token
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
        tok = self.token
        tokens, values, tops, offsets = [], [], [], []
        for t in lps:
            s = tok(t.token)[0]
            tokens.append(s)
            values.append(max(t.logprob, MIN_LOGPROB))
            tops.append({tok(tid)[0]: max(lp, MIN_LOGPROB) for tid, lp in t.top})
            offsets.append(offset)
            offset += len(s)
        return P.CompletionLogprobs(tokens, values, tops, offsets)
