"""asyncio helpers for what Python 3.11's asyncio gets wrong."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("trnd")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw`, raising TimeoutError after `timeout` seconds: asyncio.wait_for without its 3.11 flaw.
    There, a task cancelled in the loop turn in which the awaited thing finished gets that result (or its
    exception) instead of CancelledError, and the cancellation is lost (CPython gh-86296; 3.12's wait_for is
    this asyncio.timeout). A retry loop that loses its cancellation runs on for ever, and asyncio.run waits
    for it at exit: a decode server whose prefill peer was down kept dialing it after SIGTERM."""
    async with asyncio.timeout(timeout):
        return await aw


async def reconnect(connect: Callable[[], Awaitable[None]], serve: Callable[[], Awaitable[None]],
                    failed: Callable[[BaseException], None], lost: Callable[[], None], *, first_s: float = 0.2,
                    max_s: float = 5.0) -> None:
    """One link to a peer, for ever (cancel the task to end it): connect(), then serve() until it fails;
    failed(e) with why, lost() to tidy up, then wait and connect again, the wait doubling from first_s to
    max_s and back to first_s once a connect succeeds. Decode's prefill peers and the store client's stores
    keep their links this way. An unexpected exception is logged and retried like a lost link: one peer's
    task never dies."""
    backoff = first_s
    while True:
        try:
            await connect()
            backoff = first_s
            await serve()
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError, TimeoutError) as e:  # ChannelClosed is a ConnectionError
            failed(e)
        except Exception as e:
            log.exception("a peer link failed unexpectedly")
            failed(e)
        lost()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_s)
