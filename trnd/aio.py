"""asyncio helpers for what Python 3.11's asyncio gets wrong."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw`, raising TimeoutError after `timeout` seconds: asyncio.wait_for without its 3.11 flaw.
    There, a task cancelled in the loop turn in which the awaited thing finished gets that result (or its
    exception) instead of CancelledError, and the cancellation is lost (CPython gh-86296; 3.12's wait_for is
    this asyncio.timeout). A retry loop that loses its cancellation runs on for ever, and asyncio.run waits
    for it at exit: a decode server whose prefill peer was down kept dialing it after SIGTERM."""
    async with asyncio.timeout(timeout):
        return await aw
