"""One proxied OpenAI request: choose a target, send, fail over, relay the answer as it arrives.

A request that has not started streaming when its target fails (the connection refused or reset, or a
503 from a draining target) is retried on another target, `retries` times. Once bytes have reached the
client it is never retried: a stream whose target dies ends with an error event and `[DONE]`, a
non-streamed answer with a 502. A client that leaves closes the upstream request at once, so the
decode server aborts it and frees its pages.

A target that hangs (SIGSTOP, a wedged host) keeps its connections open and sends nothing: its requests
end once the probes have taken it out and it has sent nothing for HUNG_S, not after request_timeout_s
(600 s): one still waiting for its answer moves to another target, a started stream ends with an error
event and `[DONE]`. A draining target (its /ready is 503 too) that still sends is never cut. A request
the router cannot send as the client wrote it (httpx refuses it before any byte leaves) is the client's
400 and never counts against the target.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import msgspec
from starlette.types import Receive, Scope, Send

from trnd.http.errors import APIError, error_bytes
from trnd.router.policy import NoTarget, choose
from trnd.router.targets import Target

log = logging.getLogger("trnd.router")

PASS_HEADERS = ("content-type", "cache-control", "retry-after", "x-request-id")
HUNG_S = 1.0  # an unhealthy target silent this long has its requests ended (the probes found it first)


class TargetHung(httpx.TransportError):
    """The probes took the target out and it sent nothing since: it is not answering this request either."""


class Proxied:
    """The ASGI answer to one routed request (returned by the route handler, run by Starlette)."""

    def __init__(self, st, path: str, body: bytes, stream: bool, need: int, session: str | None,
                 hashes: list[int], headers: dict[str, str | bytes], method: str = "POST"):
        self.st, self.path, self.body, self.stream, self.method = st, path, body, stream, method
        self.need, self.session, self.hashes, self.headers = need, session, hashes, headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await self._serve(send, gone)
        finally:
            gone.cancel()

    async def _serve(self, send: Send, gone: asyncio.Future) -> None:
        st, tried = self.st, set()
        index = st.events.view() if st.events is not None else st.index
        for attempt in range(st.cfg.retries + 1):
            try:
                target, rule = choose(st.targets.healthy(), self.need, self.session, self.hashes, index,
                                      st.cfg.prefix_load_slack, exclude=tried, spray=self.spray())
            except NoTarget as e:
                status, code = (503, "unavailable") if e.fits else (400, "context_length_exceeded")
                return await _error(send, APIError(status, str(e), code=code, param=None if e.fits else "max_tokens",
                                                   headers={"Retry-After": "2"} if e.fits else None))
            tried.add(target.addr)
            if attempt:
                st.count_retry()
            try:
                resp = await self._send_upstream(target, gone)
            except (httpx.LocalProtocolError, httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
                st.metrics.client_errors.labels(st.model_name()).inc()  # nothing left the router: not the target's failure
                return await _error(send, APIError(400, f"The request cannot be forwarded as sent: {e}",
                                                   code="invalid_request"))
            if resp is None:  # the client left while waiting
                return
            if isinstance(resp, Exception) or resp.status_code == 503:
                why = f"{type(resp).__name__}: {resp}" if isinstance(resp, Exception) else "503"
                if isinstance(resp, httpx.Response):
                    last = await resp.aread()
                    await resp.aclose()
                    target.in_flight -= 1
                    if attempt == st.cfg.retries:  # no target left to try: its own 503 is the answer
                        return await self._relay_bytes(send, target, rule, 503, last, resp.headers)
                else:
                    st.targets.take_out(target, why)
                    index.forget(target.addr)
                st.count_failover(target)
                log.warning("request to %s failed before it started (%s): %s", target.addr, why,
                            "retrying" if attempt < st.cfg.retries else "giving up")
                continue
            if self.session:
                st.sessions.record(self.session, target.addr)
            index.record(self.hashes, target.addr)
            st.count(target, rule)
            return await self._relay(send, gone, target, rule, resp)
        await _error(send, APIError(503, "every decode server tried failed before answering", code="unavailable",
                                    headers={"Retry-After": "2"}))

    def spray(self) -> int | None:
        """The random policy's draw, except for a stored conversation (/v1/responses): it has one home."""
        return None if self.session and self.session.startswith("resp:") else self.st.next_spray()

    async def _send_upstream(self, target: Target, gone: asyncio.Future):
        """The target's response (headers read), an exception it failed with, or None if the client left."""
        req = self.st.client.build_request(self.method, f"{target.url}{self.path}", content=self.body,
                                           headers=self.headers)
        target.in_flight += 1
        sending = asyncio.ensure_future(self.st.client.send(req, stream=True))
        since = asyncio.get_running_loop().time()
        try:
            while True:
                done, _ = await asyncio.wait({sending, gone}, timeout=HUNG_S, return_when=asyncio.FIRST_COMPLETED)
                hung = not done and not target.healthy and asyncio.get_running_loop().time() - since >= HUNG_S
                if done or hung:
                    break
            if sending not in done:  # the client left first, or the target hangs: cancel, it sees the disconnect
                sending.cancel()
                with contextlib.suppress(BaseException):
                    r = await sending
                    await r.aclose()
                target.in_flight -= 1
                return TargetHung(f"{target.addr} taken out and silent") if hung else None
            try:
                return sending.result()
            except (httpx.LocalProtocolError, httpx.InvalidURL, httpx.UnsupportedProtocol):
                target.in_flight -= 1
                raise
            except httpx.HTTPError as e:
                target.in_flight -= 1
                return e
        except BaseException:
            sending.cancel()
            raise

    async def _relay(self, send: Send, gone: asyncio.Future, target: Target, rule: str, resp: httpx.Response):
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": _headers(resp.headers, target, rule)})
            chunks = resp.aiter_raw().__aiter__()
            clock = asyncio.get_running_loop().time
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                since = clock()
                while True:  # wake every HUNG_S: a target the probes took out and that stays silent is hung
                    done, _ = await asyncio.wait({nxt, gone}, timeout=HUNG_S, return_when=asyncio.FIRST_COMPLETED)
                    silent = clock() - since
                    if done or silent >= self.st.cfg.request_timeout_s or (not target.healthy and silent >= HUNG_S):
                        break
                if nxt not in done:
                    nxt.cancel()
                    if gone in done:
                        return  # the client left: closing the upstream response aborts the request there
                    if not target.healthy:
                        raise TargetHung(f"{target.addr} was taken out ({target.error}) and sent nothing for "
                                         f"{silent:.1f} s")
                    raise httpx.ReadTimeout(f"no byte from {target.addr} for {self.st.cfg.request_timeout_s} s")
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as e:  # the target died mid-answer: an error the client can see, never a hang
            log.warning("target %s failed mid-response: %s", target.addr, e)
            self.st.targets.take_out(target, f"{type(e).__name__}: {e}")
            self.st.count_failover(target)
            err = APIError(502, f"decode server {target.addr} failed during the response: {type(e).__name__}",
                           code="upstream_failed")
            tail = (b"data: " + error_bytes(err) + b"\n\ndata: [DONE]\n\n") if self.stream else b""
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": tail})
        finally:
            target.in_flight -= 1
            await resp.aclose()

    async def _relay_bytes(self, send: Send, target: Target, rule: str, status: int, body: bytes, headers) -> None:
        await send({"type": "http.response.start", "status": status, "headers": _headers(headers, target, rule)})
        await send({"type": "http.response.body", "body": body})


def _headers(upstream, target: Target, rule: str) -> list[tuple[bytes, bytes]]:
    out = [(k.encode(), v.encode()) for k, v in upstream.items() if k.lower() in PASS_HEADERS]
    return out + [(b"x-trnd-target", target.addr.encode()), (b"x-trnd-route", rule.encode())]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _error(send: Send, err: APIError) -> None:
    body = msgspec.json.encode(err.body())
    headers = [(b"content-type", b"application/json")] + [(k.lower().encode(), v.encode())
                                                          for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
