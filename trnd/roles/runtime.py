"""Run a role's asyncio side: start it, serve its HTTP app with uvicorn on uvloop, stop it on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("trnd.runtime")


def http_server(app, host: str, port: int, drain_timeout_s: float = 30.0):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, loop="none", http="httptools", log_config=None,
                                         access_log=False, lifespan="off",
                                         timeout_graceful_shutdown=int(drain_timeout_s) or None))


def run_async(main: Callable[[], Awaitable[int | None]]) -> int:
    import uvloop

    return uvloop.run(main()) or 0


async def serve_until_stopped(server, banner: str) -> None:
    print(banner, flush=True)
    await server.serve()
