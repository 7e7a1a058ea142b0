"""What every role's HTTP port shares: the app state, the probes (/health, /ready), /metrics and the
admin routes (/admin/state, abort, drain, evict). The OpenAI routes are in api/server.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd import snapshot as S
from trnd.aio import within
from trnd.api.auth import APIKeyMiddleware, find_api_key_middleware, key_swap
from trnd.api.errors import APIError, api_error_handler, http_error_handler, internal_error_handler
from trnd.api.metrics import Metrics
from trnd.config import ServeConfig
from trnd.engine.loop import EngineLoop, Unavailable

HEALTH_STALL_S = 30.0  # /health fails when the engine loop has not come round for this long
LOOP_TIMEOUT_S = 5.0  # how long admin calls wait for the engine loop
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
    auth: APIKeyMiddleware | None = None  # so a reload can swap the key
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
            t = self._tokens[tid] = self.tokenizer.token_text_bytes(tid)
        return t

    def abort_all(self) -> int:
        """End every in-flight API request with 503 (the client may retry elsewhere). Returns how many."""
        err = Unavailable("the server is shutting down")
        n = 0
        for rids in list(self.active.values()):
            for rid in rids:
                self.loop.fail(rid, err)
                n += 1
        return n

    def reload(self, cfg, live: list[str]) -> Callable[[], list[str]]:
        """daemon/lifecycle.py Readiness.reload: the live fields this app holds, checked now (the key file
        is read here), applied by the function returned."""
        new_cfg = msgspec.structs.replace(self.cfg, **{f: getattr(cfg, f) for f in live
                                                      if f in self.cfg.__struct_fields__})
        swap = key_swap(self.auth, new_cfg)

        def commit() -> list[str]:
            self.cfg = new_cfg
            return swap()
        return commit


def probe_routes() -> list[Route]:
    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]), Route("/admin/state", admin_state, methods=["GET"]),
            Route("/admin/requests/{rid:path}", admin_request, methods=["GET"])]


def admin_routes() -> list[Route]:
    return [*probe_routes(), Route("/admin/abort/{rid}", admin_abort, methods=["POST"]),
            Route("/admin/drain", admin_drain, methods=["POST"]), Route("/admin/evict", admin_evict, methods=["POST"])]


def build_admin_app(loop: EngineLoop, cfg: ServeConfig, model_name: str,
                    state_extra: Callable[[], dict] | None = None) -> Starlette:
    """Probes, metrics and admin only: for roles with no OpenAI front (prefill)."""
    routes = [*probe_routes(), Route("/admin/evict", admin_evict, methods=["POST"])]
    return make_app(routes, loop, cfg, model_name, state_extra)


def make_app(routes, loop, cfg, model_name, state_extra) -> Starlette:
    app = Starlette(routes=routes,
                    middleware=[Middleware(APIKeyMiddleware, api_key=cfg.resolved_api_key())],
                    exception_handlers={APIError: api_error_handler, HTTPException: http_error_handler,
                                        Exception: internal_error_handler})
    app.state.trnd = AppState(loop, cfg, model_name, Metrics(model_name), state_extra, ready_hold_s=cfg.ready_hold_s)
    xfers = getattr(getattr(loop, "engine", None), "xfer_metrics", None)  # (tests build apps on stub loops)
    if xfers is not None:
        xfers.model_name = model_name  # the engine's transfer samples carry the served name like the rest
    app.state.trnd.auth = find_api_key_middleware(app)
    return app


def _state(request: Request) -> AppState:
    return request.app.state.trnd


def _json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


def state_of(request: Request) -> AppState:
    return request.app.state.trnd


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


# -- probes, metrics, admin -------------------------------------------------------------------------

async def health(request: Request) -> Response:
    st = state_of(request)
    loop = st.loop
    since = time.monotonic() - loop.last_progress
    body = {"status": "ok", "last_progress_s": round(since, 3)}
    if loop.error is not None:
        body.update(status="error", error=f"engine loop crashed: {type(loop.error).__name__}: {loop.error}")
    elif since > st.health_stall_s:
        body.update(status="stalled")
    return json_response(body, 200 if body["status"] == "ok" else 503)


async def ready(request: Request) -> Response:
    st = state_of(request)
    if st.loop.error is not None:
        return json_response({"status": "error"}, 503)
    if st.draining:
        return json_response({"status": "draining"}, 503)
    if not st.serving:
        return json_response({"status": "loading"}, 503)
    return json_response({"status": "ready"})


async def metrics(request: Request) -> Response:
    st = state_of(request)
    return Response(await st.metrics.render(st.loop), media_type=CONTENT_TYPE_LATEST)


# -- admin ------------------------------------------------------------------------------------------

async def _on_loop(st: AppState, fn: Callable[[], object]):
    if st.loop.error is not None:
        raise APIError(503, "The engine loop has crashed", code="engine_error")
    try:
        return await within(st.loop.run_on_loop(fn), LOOP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"The engine loop did not answer within {LOOP_TIMEOUT_S} s", code="engine_busy") from None


async def admin_state(request: Request) -> Response:
    """The role's State (trnd/snapshot.py): the engine's part, then the role's own (state_extra)."""
    st = state_of(request)
    state = await _on_loop(st, st.loop.engine.state)
    state = msgspec.structs.replace(state, model=st.model_name, role="serve",
                                    uptime_s=round(time.monotonic() - st.started_mono, 3), draining=st.draining)
    if st.state_extra is not None:
        state = msgspec.structs.replace(state, **st.state_extra())
    return json_response(state)


async def admin_request(request: Request) -> Response:
    """One request's path through this node (snapshot.Traces): live or among the latest ended, by the id
    in its reply (a prefill role matches its `p<peer>/<id>`); 404 when this node has no such request."""
    st = state_of(request)
    rid = request.path_params["rid"]
    traces = await _on_loop(st, lambda: st.loop.engine.traces(rid))
    if not traces:
        raise APIError(404, f"No request with id {rid!r} on this node (or it ended long ago)", param="rid",
                       code="request_not_found")
    role = (st.state_extra() or {}).get("role", "serve") if st.state_extra is not None else "serve"
    return json_response(S.Traces(role=role, traces=traces))


async def admin_abort(request: Request) -> Response:
    """Abort an API request (all its choices) by the id in its reply, or one engine request by rid."""
    st = state_of(request)
    rid = request.path_params["rid"]
    rids = list(st.active.get(rid, [rid]))
    futures = [asyncio.wrap_future(st.loop.abort(r)) for r in rids]
    try:
        results = await within(asyncio.gather(*futures), LOOP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(503, f"The engine loop did not answer within {LOOP_TIMEOUT_S} s", code="engine_busy") from None
    aborted = [r for r, ok in zip(rids, results) if ok]
    if not aborted:
        raise APIError(404, f"No running request with id {rid!r}", param="rid", code="request_not_found")
    return json_response({"aborted": aborted})


async def admin_drain(request: Request) -> Response:
    st = state_of(request)
    st.draining = True
    return json_response({"draining": True, "in_flight": st.loop.num_requests})


async def admin_evict(request: Request) -> Response:
    st = state_of(request)
    freed = await _on_loop(st, st.loop.engine.radix.reset)
    return json_response({"evicted_pages": freed})
