"""API-key check as pure ASGI middleware, ahead of routing.

Deny by default: with a key configured, every HTTP path needs `Authorization: Bearer <key>` except
the probes that load balancers and Prometheus scrape without credentials. The open set is matched
exactly on the path the router will see, so no spelling of another route slips through.
"""

from __future__ import annotations

import hmac

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from trnd.http.errors import APIError, error_bytes

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                got = value
                break
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        if got[:7].lower() == b"bearer " and hmac.compare_digest(got[7:], self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # websocket: refuse the handshake
            await send({"type": "websocket.close", "code": 1008})
            return
        err = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
        body = error_bytes(err)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def key_swap(auth: APIKeyMiddleware | None, cfg) -> Callable[[], list[str]]:
    """A reload's key change: cfg's key is read now (a missing file fails before anything changes);
    the function returned puts it in place."""
    key = cfg.resolved_api_key()
    new = key.encode() if key else None

    def commit() -> list[str]:
        if auth is None or new == auth.expected:
            return []
        auth.expected = new
        return ["api key"]
    return commit


def find_api_key_middleware(app) -> APIKeyMiddleware | None:
    """The app's APIKeyMiddleware instance (so a reload can swap the key), building Starlette's
    middleware stack now rather than on the first request."""
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    node = app.middleware_stack
    while node is not None:
        if isinstance(node, APIKeyMiddleware):
            return node
        node = getattr(node, "app", None)
    return None
