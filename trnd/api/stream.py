"""Streaming plumbing of the OpenAI front: n engine streams merged into one, a reply abandoned the
moment its client disconnects, server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine

import msgspec
from starlette.types import Receive, Scope, Send

from trnd.engine.output import StepOutput


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def merge(gens: list[AsyncIterator[StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """Interleave several engine streams. The first failure ends the merge; closing the merge (or
    failing) closes every stream, which aborts their engine requests."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as g:
            async for out in g:
                yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async with contextlib.aclosing(gen) as g:
                async for out in g:
                    q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, coro: Coroutine):
    """Run coro unless the client disconnects first (then cancel it and return None)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        return None
    finally:
        for t in (work, watch):
            t.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


class EventStream:
    """A server-sent-events reply that stops (and closes its event source, aborting the engine
    requests) the moment the client disconnects, even while no event is due (a long prefill)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events, self.on_close = events, on_close
        self.status_code = 200
        h = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
             "x-accel-buffering": "no", **{k.lower(): v for k, v in (headers or {}).items()}}
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            try:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # a server that reports a gone client by failing send (ASGI spec 2.4)
                pass

        try:
            await until_disconnect(receive, pump())
        finally:
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()
