"""The engine roles' app state and admin routes (serve, decode, prefill): what the OpenAI handlers
share, /admin/state from the engine, /metrics, and abort, drain, evict. The probes and the app itself
are every role's (trnd/http/admin.py); the OpenAI routes are in api/server.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd import snapshot
from trnd.aio import within
from trnd.api.metrics import Metrics
from trnd.engine.loop import EngineLoop, Unavailable
from trnd.http.admin import Readiness, admin_app
from trnd.http.app import json_response, state_of
from trnd.http.auth import key_swap
from trnd.http.errors import APIError

LOOP_TIMEOUT_S = 5.0  # how long admin calls wait for the engine loop
EVICT_TIMEOUT_S = 120.0  # /admin/evict writes every cached page back to L2 first: a 1M-token sequence is GiBs


@dataclass(kw_only=True)
class AppState(Readiness):
    """`app.state.trnd` of an engine role: the Readiness (its progress is the engine loop) and what the
    handlers share. cfg: the role's config (ServeConfig, DecodeConfig: `api` and `http` are read per
    request; PrefillConfig)."""
    loop: EngineLoop
    cfg: object
    model_name: str
    metrics: Metrics
    state_extra: Callable[[], dict] | None = None
    active: dict[str, list[str]] = field(default_factory=dict)  # API request id -> engine rids
    _tokens: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.loop.engine.tokenizer

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
        """daemon/lifecycle.py Readiness.reload: `cfg` is the running config with the live fields changed;
        its key is read now (a missing file changes nothing), the function returned applies both."""
        swap = key_swap(self.auth, cfg.http)

        def commit() -> list[str]:
            self.cfg = cfg
            return swap()
        return commit

    async def on_loop(self, fn: Callable[[], object], timeout_s: float = LOOP_TIMEOUT_S):
        """fn() on the engine thread, bounded: a crashed or stuck loop is a 503, not a hung admin call."""
        if self.loop.error is not None:
            raise APIError(503, "The engine loop has crashed", code="engine_error")
        try:
            return await within(self.loop.run_on_loop(fn), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(503, f"The engine loop did not answer within {timeout_s} s",
                           code="engine_busy") from None

    async def state(self) -> snapshot.State:
        """The role's State (trnd/snapshot.py): the engine's part, then the role's own (state_extra)."""
        state = await self.on_loop(self.loop.engine.state)
        state = msgspec.structs.replace(state, model=self.model_name, role="serve", draining=self.draining,
                                        uptime_s=round(time.monotonic() - self.started_mono, 3))
        if self.state_extra is not None:
            state = msgspec.structs.replace(state, **self.state_extra())
        return state


def admin_routes() -> list[Route]:
    return [Route("/admin/requests/{rid:path}", admin_request, methods=["GET"]),
            Route("/admin/abort/{rid}", admin_abort, methods=["POST"]),
            Route("/admin/drain", admin_drain, methods=["POST"]), Route("/admin/evict", admin_evict, methods=["POST"])]


def build_admin_app(loop: EngineLoop, cfg, model_name: str, state_extra: Callable[[], dict] | None = None) -> Starlette:
    """Probes, metrics and admin only: for roles with no OpenAI front (prefill)."""
    routes = [Route("/admin/requests/{rid:path}", admin_request, methods=["GET"]),
              Route("/admin/evict", admin_evict, methods=["POST"])]
    return make_app(routes, loop, cfg, model_name, state_extra)


def make_app(routes, loop: EngineLoop, cfg, model_name: str, state_extra=None,
             ready_hold_s: float | None = None) -> Starlette:
    st = AppState(loop=loop, progress=loop, cfg=cfg, model_name=model_name, metrics=Metrics(model_name),
                  state_extra=state_extra)
    if ready_hold_s is not None:
        st.ready_hold_s = ready_hold_s
    xfers = getattr(getattr(loop, "engine", None), "xfer_metrics", None)  # (tests build apps on stub loops)
    if xfers is not None:
        xfers.model_name = model_name  # the engine's transfer samples carry the served name like the rest
    return admin_app(routes, st, state=st.state, metrics=lambda: st.metrics.render(st.loop),
                     api_key=cfg.http.resolved_api_key())


# -- admin ------------------------------------------------------------------------------------------

async def admin_request(request: Request) -> Response:
    """One request's path through this node (snapshot.Traces): live or among the latest ended, by the id
    in its reply (a prefill role matches its `p<peer>/<id>`); 404 when this node has no such request."""
    st: AppState = state_of(request)
    rid = request.path_params["rid"]
    traces = await st.on_loop(lambda: st.loop.engine.traces(rid))
    if not traces:
        raise APIError(404, f"No request with id {rid!r} on this node (or it ended long ago)", param="rid",
                       code="request_not_found")
    role = (st.state_extra() or {}).get("role", "serve") if st.state_extra is not None else "serve"
    return json_response(snapshot.Traces(role=role, traces=traces))


async def admin_abort(request: Request) -> Response:
    """Abort an API request (all its choices) by the id in its reply, or one engine request by rid."""
    st: AppState = state_of(request)
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
    st: AppState = state_of(request)
    st.draining = True
    return json_response({"draining": True, "in_flight": st.loop.num_requests})


async def admin_evict(request: Request) -> Response:
    st: AppState = state_of(request)
    freed = await st.on_loop(st.loop.engine.radix.reset, EVICT_TIMEOUT_S)
    return json_response({"evicted_pages": freed})
