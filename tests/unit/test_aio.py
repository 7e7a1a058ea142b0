"""trnd.aio.within: a bounded await that never loses a cancellation (asyncio.wait_for does, on 3.11)."""

from __future__ import annotations

import asyncio

import pytest

from trnd.aio import within


def _cancel_as_it_fails(bounded) -> str:
    """A retry-style waiter whose awaited connect fails in the very loop turn its task is cancelled: what a
    decode server's peer task met at SIGTERM while its prefill peer refused connections."""
    async def main() -> str:
        fut = asyncio.get_running_loop().create_future()

        async def waiter() -> str:
            try:
                await bounded(fut, 5.0)
            except ConnectionRefusedError:
                return "the cancellation was lost: the retry loop would dial again"
            return "returned"

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the task now waits on fut
        fut.set_exception(ConnectionRefusedError("refused"))
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    return asyncio.run(main())


def test_a_cancellation_is_kept_when_the_awaited_thing_ends_in_the_same_turn():
    assert _cancel_as_it_fails(within) == "cancelled"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_times_out_and_passes_results_and_errors_through(loop):
    async def main():
        assert await within(asyncio.sleep(0, "x"), 1.0) == "x"
        assert await within(asyncio.sleep(0, "y"), None) == "y"
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(10), 0.05)
        with pytest.raises(ConnectionRefusedError):
            await within(asyncio.open_connection("127.0.0.1", _refused_port()), 5.0)

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _refused_port() -> int:
    from tests.launch import refused_port

    return refused_port()


def test_the_package_bounds_its_awaits_with_within():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "trnd"
    users = [str(p.relative_to(root)) for p in root.rglob("*.py") if "asyncio.wait_for(" in p.read_text()]
    assert users == [], f"asyncio.wait_for loses cancellations on 3.11: use trnd.aio.within in {users}"
