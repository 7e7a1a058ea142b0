"""The probes every role answers the same way, and the app they are built into.

`Readiness` is what /health and /ready read and what the daemon's Lifecycle flips (ready once the
role can serve, draining on SIGTERM; daemon/lifecycle.py), and it holds a request that arrives before
the role can serve it. `admin_app` is a role's Starlette app: /health, /ready, /metrics and
/admin/state from the role's functions, the role's own routes, the API-key middleware and the OpenAI
error schema for every failure. The OpenAI server (api/), the router (router/), prefill and the store
(roles/) each build theirs here.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd.http.app import json_response, state_of
from trnd.http.auth import APIKeyMiddleware, find_api_key_middleware, key_swap
from trnd.http.errors import HANDLERS, APIError

# No `*_created` series beside every counter and histogram (as vLLM): a process's start time is not a
# per-series fact dashboards read, and it doubles the scrape.
disable_created_metrics()

HEALTH_STALL_S = 30.0  # /health fails when the role's loop has not come round for this long
READY_HOLD_S = 30.0  # a request that arrives before the role can serve it waits this long, then 503


@dataclass(kw_only=True)
class Readiness:
    """`app.state.trnd`. progress: what /health follows (`error`, `last_progress`: an EngineLoop, or the
    Lifecycle's Beat of an asyncio-only role); ready_fn: the role's own readiness (decode: a prefill peer
    handshaked; router: a healthy target), not_ready_why: what it waits for, for the 503's message."""
    progress: object | None = None
    ready: bool = True
    draining: bool = False
    ready_fn: Callable[[], bool] | None = None
    not_ready_why: Callable[[], str] | None = None
    ready_hold_s: float = READY_HOLD_S
    health_stall_s: float = HEALTH_STALL_S
    auth: APIKeyMiddleware | None = None  # so a reload can swap the key
    started: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)

    @property
    def crashed(self) -> BaseException | None:
        return self.progress.error if self.progress is not None else None

    @property
    def serving(self) -> bool:
        """A request sent now is served: started, the loop alive, and the role's own readiness holds."""
        return self.ready and self.crashed is None and (self.ready_fn is None or self.ready_fn())

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise APIError(503, "The server is draining and accepts no new requests", code="draining",
                           headers={"Retry-After": "1"})

    async def wait_serving(self) -> None:
        """Ready means ready: a request (and /v1/models, which clients poll to learn that the server is
        up) is held until the role can serve it, for at most ready_hold_s, then answered 503 with
        Retry-After. Covers start-up and a role that lost what it serves through (every prefill peer,
        every router target) while the supervisor restarts one."""
        deadline = time.monotonic() + self.ready_hold_s
        while not self.serving:
            self.refuse_if_draining()
            if time.monotonic() >= deadline:
                why = self.not_ready_why() if self.not_ready_why is not None else "starting"
                raise APIError(503, f"The server is not ready to serve yet ({why}); retry later",
                               code="not_ready", headers={"Retry-After": "2"})
            await asyncio.sleep(0.05)

    def health(self) -> tuple[dict, int]:
        """Alive: the loop has not crashed and came round within health_stall_s."""
        body: dict = {"status": "ok"}
        last = self.progress.last_progress if self.progress is not None else None
        if last is not None:
            body["last_progress_s"] = round(time.monotonic() - last, 3)
        if self.crashed is not None:
            body.update(status="error", error=f"loop crashed: {type(self.crashed).__name__}: {self.crashed}")
        elif last is not None and body["last_progress_s"] > self.health_stall_s:
            body.update(status="stalled")
        return body, 200 if body["status"] == "ok" else 503

    def readiness(self) -> tuple[dict, int]:
        status = ("error" if self.crashed is not None else "draining" if self.draining
                  else "ready" if self.serving else "loading")
        return {"status": status}, 200 if status == "ready" else 503

    def reload(self, cfg, live: list[str]) -> Callable[[], list[str]]:
        """daemon/lifecycle.py Readiness.reload: the key is read now (a missing file fails before anything
        changes); the function returned puts it in place. Roles with more live settings extend it. cfg: the
        role's config, with the live fields changed; its `http` part holds the key."""
        return key_swap(self.auth, cfg.http)


async def _value(x):
    return await x if inspect.isawaitable(x) else x


def probe_routes(state: Callable[[], object], metrics: Callable[[], object]) -> list[Route]:
    """/health, /ready (the Readiness on the app), /metrics (Prometheus text from `metrics()`) and
    /admin/state (the trnd/snapshot.py State from `state()`); either function may be async."""
    async def health(request: Request) -> Response:
        return json_response(*state_of(request).health())

    async def ready(request: Request) -> Response:
        return json_response(*state_of(request).readiness())

    async def metrics_text(request: Request) -> Response:
        return Response(await _value(metrics()), media_type=CONTENT_TYPE_LATEST)

    async def admin_state(request: Request) -> Response:
        return json_response(await _value(state()))

    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics_text, methods=["GET"]), Route("/admin/state", admin_state, methods=["GET"])]


def admin_app(routes: list[Route], readiness: Readiness, *, state: Callable[[], object],
              metrics: Callable[[], object], api_key: str | None) -> Starlette:
    """A role's app: the probes, then its own routes; every path but the probes takes the key."""
    app = Starlette(routes=[*probe_routes(state, metrics), *routes],
                    middleware=[Middleware(APIKeyMiddleware, api_key=api_key)], exception_handlers=HANDLERS)
    app.state.trnd = readiness
    readiness.auth = find_api_key_middleware(app)
    return app
