"""The engine roles' app in process, through Starlette's ASGI transport: drain, an internal error as a
generic 500, /health when the engine loop stalls."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.checks import assert_error

MAX_MODEL_LEN = 4096


# -- in process: draining, internal errors ----------------------------------------------------------

@pytest.fixture(scope="module")
def engine_loop(tiny_qwen3):
    from trnd.engine.build import EngineConfig, build
    from trnd.engine.engine import Engine
    from trnd.engine.loop import EngineLoop

    loop = EngineLoop(Engine(build(EngineConfig(model=str(tiny_qwen3), num_pages=64, max_model_len=MAX_MODEL_LEN))), 8)
    loop.start()
    yield loop
    loop.stop()


def _asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app, raise_app_exceptions=False),
                             base_url="http://test", timeout=30)


def test_drain_refuses_new_requests(engine_loop):
    from trnd.api.server import build_app
    from trnd.config import ServeConfig

    app = build_app(engine_loop, ServeConfig(), "tiny", state_extra=lambda: {"peers": ["a"]})

    async def main():
        async with _asgi_client(app) as c:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            state = (await c.get("/admin/state")).json()
            assert state["peers"] == ["a"] and state["draining"] is False and state["role"] == "serve"
            assert (await c.get("/ready")).status_code == 200
            r = await c.post("/admin/drain")
            assert r.status_code == 200 and r.json()["draining"] is True
            assert app.state.trnd.draining is True
            assert (await c.get("/ready")).status_code == 503
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/admin/state")).json()["draining"] is True
            return await c.post("/v1/completions", json=body), await c.post("/v1/chat/completions", json=body)

    for r in asyncio.run(main()):
        assert_error(r, 503, code="draining")


def test_internal_error_is_generic_500(engine_loop):
    from trnd.api.server import build_app
    from trnd.config import ServeConfig

    def boom():
        raise RuntimeError("secret detail /etc/passwd")

    app = build_app(engine_loop, ServeConfig(), "tiny", state_extra=boom)

    async def main():
        async with _asgi_client(app) as c:
            return await c.get("/admin/state")

    r = asyncio.run(main())
    err = assert_error(r, 500, code="internal_error")
    assert "secret" not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
    assert err["type"] == "server_error"


def test_health_fails_when_loop_stalls(engine_loop):
    from trnd.api.server import build_app
    from trnd.config import ServeConfig

    app = build_app(engine_loop, ServeConfig(), "tiny")

    async def main():
        async with _asgi_client(app) as c:
            ok = await c.get("/health")
            app.state.trnd.health_stall_s = -1.0  # as if the last loop turn were long ago
            return ok, await c.get("/health")

    ok, stalled = asyncio.run(main())
    assert ok.status_code == 200
    assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
