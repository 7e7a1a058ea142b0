"""What the `trnd top` tests share: recorded /admin/state snapshots (tests/top_data), a fake trnd
serving them, and a Pilot wait."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path


from trnd.top.model import NodeTrack, Poll

from tests.launch import free_port


DATA = Path(__file__).parent / "top_data"


def states(role: str) -> list[dict]:
    return json.loads((DATA / f"{role}.json").read_text())


def track_of(role: str, upto: int | None = None, name: str = "n") -> NodeTrack:
    t = NodeTrack(name)
    for st in states(role)[:upto]:
        t.update(Poll(st, ready="ready"), 0.0)
    return t


# -- a fake trnd: answers /admin/state from recordings, optionally slowly ------------------------------

class FakeTrnd:
    """A tiny HTTP/1.1 server on its own thread and loop: TCP or a unix socket."""

    def __init__(self, seq: list[dict] | None = None, delay: float = 0.0, uds: str | None = None,
                 port: int | None = None):
        self.seq, self.delay, self.uds = seq or [], delay, uds
        self.port = port or free_port()
        self.ready = "ready"
        self.requests: list[tuple[str, str, str | None]] = []
        self.open: set[int] = set()  # requests accepted and not answered, client still connected
        self.most_open = 0
        self.count = 0
        self.served = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def pending(self) -> int:
        return len(self.open)

    async def handle(self, reader, writer):
        self.count += 1
        me = self.count
        self.open.add(me)
        self.most_open = max(self.most_open, len(self.open))
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            auth = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith("authorization:")),
                        None)
            self.requests.append((method, path, auth))
            if self.delay:
                try:  # answer late, unless the client gives up first (EOF)
                    await asyncio.wait_for(reader.read(1), self.delay)
                    return
                except asyncio.TimeoutError:
                    pass
            if path == "/admin/state":
                body = self.seq[min(self.served, len(self.seq) - 1)]
                self.served += 1
                code = 200
            elif path == "/ready":
                body, code = {"status": self.ready}, 200 if self.ready == "ready" else 503
            else:
                body, code = {"ok": True, "path": path}, 200
            data = json.dumps(body).encode()
            writer.write(f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open.discard(me)
            writer.close()

    def start(self) -> FakeTrnd:
        self.thread.start()

        async def serve():
            if self.uds:
                self.server = await asyncio.start_unix_server(self.handle, self.uds)
            else:
                self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)

        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(5)
        return self

    @property
    def url(self) -> str:
        return f"unix:{self.uds}" if self.uds else f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def shut():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def until(pilot, pred, timeout: float = 10.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        await pilot.pause(step)
    return pred()


