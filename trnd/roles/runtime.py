"""Run a role's asyncio side: uvicorn on uvloop, with the signals left to the role's Lifecycle."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import uvicorn

from trnd.config import AdminPort, HTTPConfig

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


def http_server(app, http: HTTPConfig | AdminPort, sock=None) -> HTTPServer:
    """uvicorn for the role's port: an HTTP front's (HTTPConfig: the header limits of a public port too) or
    an admin port's. sock: the port, bound at start (trnd.procs.bind_port); None: uvicorn binds it itself."""
    from trnd.http.guard import protocol

    if isinstance(http, HTTPConfig):
        port, proto = http.port, protocol(http.max_header_bytes, http.header_timeout_s)
    else:
        port, proto = http.admin_port, protocol()
    server = HTTPServer(uvicorn.Config(app, host=http.host, port=port, loop="none", http=proto, log_config=None,
                                       access_log=False, lifespan="off",
                                       timeout_graceful_shutdown=int(http.drain_timeout_s) or None))
    server.sockets = [sock] if sock is not None else None
    return server


def run_async(main: Callable[[], Awaitable[int | None]]) -> int:
    import uvloop

    return uvloop.run(main()) or 0
