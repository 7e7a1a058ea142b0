"""What every handler on a trnd port shares: the body read within a limit, JSON replies, the app's state."""

from __future__ import annotations

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from trnd.http.errors import APIError


def state_of(request: Request):
    """`app.state.trnd`: the role's Readiness (admin.py), or its subclass (api/app.py AppState, router/app.py
    RouterState)."""
    return request.app.state.trnd


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


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
