"""One proxied OpenAI request: choose a target, send, fail over, relay the answer as it arrives.

A request that has not started streaming when its target fails (the connection refused or reset, or a
503 from a draining target) is retried on another target, `retries` times. Once bytes have reached the
client it is never retried: a stream whose target dies ends with an error event and `[DONE]`, a
non-streamed answer with a 502. A client that leaves closes the upstream request at once, so the
decode server aborts it and frees its pages.
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


class Proxied:
    """The ASGI answer to one routed request (returned by the route handler, run by Starlette)."""

    def __init__(self, st, path: str, body: bytes, stream: bool, need: int, session: str | None,
                 hashes: list[int], headers: dict[str, str]):
        self.st, self.path, self.body, self.stream = st, path, body, stream
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
                                      st.cfg.prefix_load_slack, exclude=tried, spray=st.next_spray())
            except NoTarget as e:
                status, code = (503, "unavailable") if e.fits else (400, "context_length_exceeded")
                return await _error(send, APIError(status, str(e), code=code, param=None if e.fits else "max_tokens",
                                                   headers={"Retry-After": "2"} if e.fits else None))
            tried.add(target.addr)
            if attempt:
                st.count_retry()
            resp = await self._send_upstream(target, gone)
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
                target.sessions.add(self.session)
            index.record(self.hashes, target.addr)
            st.count(target, rule)
            return await self._relay(send, gone, target, rule, resp)
        await _error(send, APIError(503, "every decode server tried failed before answering", code="unavailable",
                                    headers={"Retry-After": "2"}))

    async def _send_upstream(self, target: Target, gone: asyncio.Future):
        """The target's response (headers read), an exception it failed with, or None if the client left."""
        req = self.st.client.build_request("POST", f"{target.url}{self.path}", content=self.body, headers=self.headers)
        target.in_flight += 1
        sending = asyncio.ensure_future(self.st.client.send(req, stream=True))
        try:
            done, _ = await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            if sending not in done:  # the client left first: cancel, the target sees the disconnect
                sending.cancel()
                with contextlib.suppress(BaseException):
                    r = await sending
                    await r.aclose()
                target.in_flight -= 1
                return None
            try:
                return sending.result()
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
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                done, _ = await asyncio.wait({nxt, gone}, timeout=self.st.cfg.request_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    if gone in done:
                        return  # the client left: closing the upstream response aborts the request there
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
