"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure.

Clients (the openai SDK, LangChain, curl scripts) branch on status and `code`, so bad input is always
a 4xx naming the offending field, overload is a 503 with Retry-After, and an unexpected exception is
a generic 500 whose traceback goes to the log, never into the body.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger("trnd.http")

class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """Raised anywhere in a handler; the app turns it into the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # OpenAI's two types: the client's fault (the code says which: model_not_found, invalid_api_key...)
        # or the server's
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorInfo(self.message, self.type, self.param, self.code))


def error_bytes(err: APIError) -> bytes:
    return msgspec.json.encode(err.body())


def error_response(err: APIError) -> Response:
    return Response(error_bytes(err), status_code=err.status, media_type="application/json", headers=err.headers)


# -- handlers installed on every app (app.py) -------------------------------------------------------

async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Router 404/405 (and any HTTPException) in the same schema as everything else."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"Not found: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"Method {request.method} not allowed for {request.url.path}"
    else:
        msg = str(exc.detail)
    return error_response(APIError(exc.status_code, msg, headers=dict(exc.headers or {})))


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """Last resort: a generic body. Starlette re-raises after sending it, so the server logs the
    traceback once (uvicorn's "Exception in ASGI application"); here only the request line."""
    log.error("internal error on %s %s: %s", request.method, request.url.path, type(exc).__name__)
    return error_response(APIError(500, "Internal server error", type="server_error", code="internal_error"))


HANDLERS = {APIError: api_error_handler, HTTPException: http_error_handler, Exception: internal_error_handler}
