"""`trnd top` under Pilot against a real `trnd serve` with traffic: the batch table, the cache bars,
abort, evict and drain through the UI."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from contextlib import redirect_stdout

import httpx
import pytest

from trnd.top.app import ConfirmScreen, RequestScreen, TopApp
from trnd.top.cli import main as top_main
from trnd.top.client import parse_target
from trnd.top.panels import BatchPanel, CacheCard, NodesPanel

from tests.launch import start_serve, stop, wait_ready

from tests.top import until


# -- a real trnd serve ------------------------------------------------------------------------------

KEY = "top-test-key"


class Traffic:
    """Streaming chat requests that keep running (ignore_eos, many tokens) on background threads."""

    def __init__(self, port: int):
        self.port, self.threads = port, []

    def start(self, n: int, max_tokens: int = 8000) -> None:
        # as long as the default point (8k context) allows: 6000 finished in ~10 s at the compiled kernels' speed,
        # sometimes before the abort test got to it; 3 x 8000 tokens fit the fixture's 0.02 GB pool (~40k tokens)
        for i in range(n):
            body = {"model": "tiny-qwen3", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                    "session_id": f"top-{len(self.threads)}",
                    "messages": [{"role": "user", "content": f"tell me a long story number {i}"}]}
            th = threading.Thread(target=self._run, args=(body,), daemon=True)
            th.start()
            self.threads.append(th)

    def _run(self, body) -> None:
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    def stop(self) -> None:
        """Abort whatever still runs (the streams then end)."""
        try:
            st = admin(self.port)
            for r in st["running"] + st["waiting"]:
                httpx.post(f"http://127.0.0.1:{self.port}/admin/abort/{r['id']}", timeout=10,
                           headers={"Authorization": f"Bearer {KEY}"})
        except httpx.HTTPError:
            pass
        for th in self.threads:
            th.join(10)


def admin(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/admin/state", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).json()


@pytest.fixture
def served(tiny_qwen3, monkeypatch):
    # every engine step sleeps 5 ms (the lifecycle's test hook), so 8000 tokens take 40 s or more however fast
    # the kernels get: the requests are still running when the test aborts one and counts the others
    monkeypatch.setenv("TRND_DEBUG_STALL_S", "0.005")
    proc, port = start_serve(tiny_qwen3, "--api-key", KEY, "--kv-memory-gb", "0.02",
                             "--threads", "1")
    traffic = Traffic(port)
    try:
        wait_ready(port, proc)
        yield port, traffic
    finally:
        traffic.stop()
        stop(proc)


def _bar_blocks(app) -> int:
    card = app.query_one(CacheCard)
    return card.render().plain.split("\n")[1].count("█")


@pytest.mark.slow
def test_live_batch_cache_abort_and_drain(served):
    port, traffic = served

    async def go():
        # a generous poll timeout: on a loaded machine a late answer must not blank the table
        app = TopApp([parse_target(f"127.0.0.1:{port}", KEY)], interval=0.3, timeout=5.0)
        async with app.run_test(size=(120, 36)) as pilot:
            track = app.tracks[0]
            assert await until(pilot, lambda: track.status == "ready")
            await pilot.press("3")
            await pilot.pause(0.1)
            assert _bar_blocks(app) == 0  # idle: no page in use

            await asyncio.to_thread(traffic.start, 3)
            running = await until(pilot, lambda: len(admin(port)["running"]) == 3 and admin(port)["running"], 30)
            rids = {r["id"] for r in running}
            await pilot.press("2")
            batch = app.query_one(BatchPanel)
            table = batch.query_one("DataTable")
            assert await until(pilot, lambda: {r.id for r in batch.rows.values()} == rids)
            assert table.row_count == 3
            assert await until(pilot, lambda: all(r.generated > 0 and r.state == "decoding"
                                                  for r in batch.rows.values()))
            await pilot.press("3")
            assert await until(pilot, lambda: _bar_blocks(app) > 0)  # the device bar moved

            # enter opens the request's detail screen
            await pilot.press("2")
            table.move_cursor(row=1)
            target = batch.selected()
            await pilot.press("enter")
            assert await until(pilot, lambda: isinstance(app.screen, RequestScreen))
            assert app.screen.key == target.key
            await pilot.press("escape")
            assert await until(pilot, lambda: not isinstance(app.screen, RequestScreen))

            # abort: cancelled first (nothing happens), then confirmed
            await pilot.press("a")
            assert await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("n")
            assert await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
            await pilot.pause(0.5)
            assert target.id in {r["id"] for r in admin(port)["running"]}
            assert batch.selected().id == target.id  # the cursor stayed on its row across refreshes
            await pilot.press("a")
            assert await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("y")
            assert await until(pilot, lambda: target.id not in {r["id"] for r in admin(port)["running"]}, 10)
            assert await until(pilot, lambda: target.key not in batch.rows)
            assert len(admin(port)["running"]) == 2

            # drain the node from the nodes panel
            await pilot.press("1", "d")
            assert await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("y")
            ready = lambda: httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code  # noqa: E731
            assert await until(pilot, lambda: ready() == 503, 10)
            assert await until(pilot, lambda: track.status == "draining")
            nodes = app.query_one(NodesPanel).query_one("DataTable")
            assert nodes.get_cell_at((0, 2)).plain == "draining"
            await pilot.press("q")

    asyncio.run(go())


def test_live_once_and_evict(served):
    port, traffic = served
    traffic.start(2, max_tokens=4000)
    deadline = time.time() + 30
    while time.time() < deadline and len(admin(port)["running"]) < 2:
        time.sleep(0.1)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = top_main([f"http://127.0.0.1:{port}", "--api-key", KEY, "--once"])
    assert rc == 0
    text = out.getvalue()
    assert "top-0" in text and "top-1" in text and "decoding" in text and "ready" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert top_main([f"http://127.0.0.1:{port}", "--once"]) == 1  # no key: 401, an error
    assert "HTTP 401" in out.getvalue()
    traffic.stop()
    assert admin(port)["pages"]["cached"] > 0

    async def go():
        app = TopApp([parse_target(f"127.0.0.1:{port}", KEY)], interval=0.3, timeout=5.0)
        async with app.run_test() as pilot:
            assert await until(pilot, lambda: app.tracks[0].status == "ready")
            await pilot.press("e")
            assert await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("y")
            assert await until(pilot, lambda: admin(port)["pages"]["cached"] == 0)
            await pilot.press("q")

    asyncio.run(go())


