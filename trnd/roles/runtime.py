"""Run a role's asyncio side: uvicorn on uvloop, with the signals left to the role's Lifecycle."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import uvicorn

log = logging.getLogger("trnd.runtime")


class HTTPServer(uvicorn.Server):
    """uvicorn without its own SIGTERM/SIGINT handlers: uvicorn would stop listening at once, while
    trnd must keep answering (/ready 503, streams running) through the drain. The Lifecycle owns the
    signals and ends serving by setting `should_exit` once the drain is done."""

    sockets: list | None = None  # bound at start (trnd.procs.bind_port); uvicorn listens on them

    def capture_signals(self):
        return contextlib.nullcontext()

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets=sockets or self.sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if sockets:  # bound at start: the listen may have lost the port (trnd.procs.check_listening)
            from trnd.procs import check_listening

            for server in self.servers:
                check_listening(server, f"{self.config.host}:{self.config.port}")

    def listening(self) -> list[str]:
        """host:port of every socket it listens on (what the role reports to a supervisor)."""
        from trnd.daemon.lifecycle import listening

        return listening(self)


def http_server(app, host: str, port: int, drain_timeout_s: float = 30.0, cfg=None, sock=None) -> HTTPServer:
    """cfg (ServeConfig): max_header_bytes and header_timeout_s of the public port. sock: the port,
    bound at start (trnd.procs.bind_port); None: uvicorn binds host:port itself when it starts."""
    from trnd.http.guard import HEADER_TIMEOUT_S, MAX_HEADER_BYTES, protocol

    proto = protocol(getattr(cfg, "max_header_bytes", MAX_HEADER_BYTES), getattr(cfg, "header_timeout_s", HEADER_TIMEOUT_S))
    server = HTTPServer(uvicorn.Config(app, host=host, port=port, loop="none", http=proto, log_config=None,
                                       access_log=False, lifespan="off",
                                       timeout_graceful_shutdown=int(drain_timeout_s) or None))
    server.sockets = [sock] if sock is not None else None
    return server


def run_async(main: Callable[[], Awaitable[int | None]]) -> int:
    import uvloop

    return uvloop.run(main()) or 0
