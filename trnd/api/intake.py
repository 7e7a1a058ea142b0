"""What every OpenAI route does with a request before the engine sees it: the body (trnd/http read_body)
decoded into its Struct (a 400 naming the field), the model name checked, text tokenized off the event
loop when long, the session named."""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request

from trnd.api import protocol as P
from trnd.api.app import AppState
from trnd.api.errors import from_decode_error
from trnd.http.app import read_body
from trnd.http.errors import APIError
from trnd.http.tenant import bearer, tenant_salt

INLINE_TOKENIZE_CHARS = 16384  # longer texts are tokenized on a worker thread, off the event loop


async def decode(request: Request, st: AppState, typ: type, generates: bool = True):
    """The request body as `typ`. A request that generates is refused while draining and waits until the
    server can serve it (AppState.wait_serving); one that only tokenizes is answered at once."""
    if generates:
        st.refuse_if_draining()
    body = await read_body(request, st.cfg.http.max_body_bytes)
    if generates:
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
    typ = BODY_TYPES.get(path)
    if typ is None:  # /v1/responses, the tokenizer routes: the decode server's own answer
        return
    try:
        msgspec.json.decode(body, type=typ)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except RecursionError:  # msgspec's nesting limit
        raise APIError(400, "The request body is nested too deeply", code="invalid_json") from None


async def encode(st: AppState, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return st.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(st.tokenizer.encode, text, add_special_tokens=add_special_tokens)


def session_of(req, request: Request) -> str | None:
    """The body's session_id (or OpenAI's prompt_cache_key), else the x-session-id header the router forwards
    (and that clients of the router may send instead of a body field)."""
    return req.session_id or req.prompt_cache_key or request.headers.get("x-session-id") or None


def salt_of(req, request: Request, st: AppState) -> str | None:
    """The tenant's cache salt (http/tenant.py): the key this request was accepted with, where the server
    has one, and the body's cache_salt."""
    keyed = st.auth is not None and st.auth.expected is not None
    return tenant_salt(bearer(request.headers) if keyed else None, req.cache_salt)


def prefill_hint(request: Request) -> str | None:
    """The prefill peer a router found holding this prompt's prefix (x-trnd-prefill; a decode server only)."""
    hint = request.headers.get("x-trnd-prefill")
    return hint[:256] if hint else None
