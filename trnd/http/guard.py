"""uvicorn's httptools protocol with the edges a public port needs: a cap on the request line +
headers (431, before they are buffered), a deadline for them to arrive (a client sending a byte a
second is closed), and HTTP/1.0 streams delimited by closing the connection (1.0 has no chunked
encoding)."""

from __future__ import annotations

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

MAX_HEADER_BYTES = 64 * 2**10
HEADER_TIMEOUT_S = 10.0


def _error(status: int, reason: str, message: str, code: str) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                          "code": code}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class CloseDelimitedCycle(RequestResponseCycle):
    """An HTTP/1.0 reply without a length: no transfer-encoding, the body ends when the connection does."""

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.chunked_encoding = False  # uvicorn then adds no transfer-encoding
            self.keep_alive = False
            return await super().send(message)
        if message["type"] != "http.response.body" or self.response_complete or self.disconnected:
            return await super().send(message)
        if self.flow.write_paused:
            await self.flow.drain()
        if message.get("body"):
            self.transport.write(message["body"])
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()
            self.on_response()


class GuardedHttpTools(HttpToolsProtocol):
    max_header_bytes = MAX_HEADER_BYTES
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_bytes = 0
        self._in_headers = True
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            self.transport.write(_error(408, "Request Timeout", f"the request headers did not arrive within "
                                                               f"{self.header_timeout_s:g} s", "header_timeout"))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            before = self._header_bytes
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes and not self._ends_in_time(data, before):
                self.transport.write(_error(431, "Request Header Fields Too Large",
                                            f"the request line and headers exceed {self.max_header_bytes} bytes",
                                            "header_too_large"))
                self.transport.close()
                return
        super().data_received(data)

    def _ends_in_time(self, data: bytes, before: int) -> bool:
        """Whether the blank line ending the headers is in `data` within the limit (the rest is body)."""
        end = data.find(b"\r\n\r\n", 0, max(0, self.max_header_bytes - before))
        return end >= 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # the next request on a kept-alive connection
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().on_headers_complete()
        if self.cycle is not None and self.scope.get("http_version") == "1.0":
            self.cycle.__class__ = CloseDelimitedCycle

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_headers, self._header_bytes = True, 0

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def protocol(max_header_bytes: int = MAX_HEADER_BYTES, header_timeout_s: float = HEADER_TIMEOUT_S) -> type:
    return type("GuardedHttpTools", (GuardedHttpTools,), {"max_header_bytes": max_header_bytes,
                                                          "header_timeout_s": header_timeout_s})
