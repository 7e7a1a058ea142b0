"""EngineLoop: runs the Engine on its own thread and bridges it to asyncio servers.

All engine state is touched only on the loop thread: servers send it closures through an inbox
(add, abort, snapshot), and it hands each request's StepOutputs back to that request's asyncio queue.
A step that hangs stops `last_progress` from moving, which /health and the systemd watchdog read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from trnd.engine.engine import Engine
from trnd.engine.output import StepOutput
from trnd.sampling_params import SamplingParams

log = logging.getLogger("trnd.engine")

IDLE_CHECK_S = 0.5  # the loop checks the page pool once it has had no work for this long ...
CHECK_EVERY_S = 10.0  # ... and not more often than this
PARKED_POLL_S = 0.01  # parked work with nothing about to land: the loop's fallback poll (deadlines, tiers)


class Unavailable(RuntimeError):
    """The server cannot take this request now (503 with Retry-After): overloaded, draining, or no
    prefill peer reachable. The message says which."""


class DeadlineExceeded(RuntimeError):
    """A step of the request did not happen in time (504): the message says which (a KV handoff)."""


class QueueFull(Unavailable):
    """More requests in flight than the configured limit: the client should retry later."""


class EngineLoop:
    def __init__(self, engine: Engine, max_requests: int = 1024, poll: Callable[[], bool] | None = None,
                 on_output: Callable[[StepOutput], None] | None = None):
        """poll: called every iteration on the loop thread (a role's transfer progress); returns True
        while something is in flight, so the loop keeps spinning briefly instead of sleeping.
        on_output: takes every StepOutput instead of the per-request queues (the prefill role)."""
        self.engine = engine
        self.poll = poll
        self.on_output = on_output
        self.max_requests = max_requests
        self.last_progress = time.monotonic()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._reserved: set[str] = set()  # admitted by the API (reserve), generate() not started yet
        self._thread = threading.Thread(target=self._run, name="trnd-engine", daemon=True)
        self.stall_s = 0.0  # test hook: a step that takes this long (a hung loop, for watchdog tests)

    def start(self) -> "EngineLoop":
        from trnd.backends.omp import release_threads

        release_threads()  # the engine thread's OpenMP team is the only one (backends/omp.py)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Also safe before start(): a role stopped while it warms up unwinds through here."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    @property
    def num_requests(self) -> int:
        return len(self._queues) + len(self._reserved)

    def reserve(self, rids: list[str]) -> bool:
        """Admit these requests now (from the server's event loop, before any reply starts), or refuse
        all of them: over max_requests. generate() of a reserved rid is never refused for the limit."""
        if self.num_requests + len(rids) > self.max_requests:
            return False
        self._reserved.update(rids)
        return True

    def unreserve(self, rids: list[str]) -> None:
        """Give back what was reserved and never started (the client left first)."""
        self._reserved.difference_update(rids)

    # -- called from any thread ---------------------------------------------------------------------

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run fn on the loop thread between steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)

        self._inbox.put(run)
        self._wake.set()
        return fut

    async def run_on_loop(self, fn: Callable[[], object]):
        return await asyncio.wrap_future(self.call(fn))

    async def generate(self, prompt_ids: list[int], params: SamplingParams, rid: str,
                       session_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs. Cancelling the consumer (client gone) aborts the request."""
        self.engine.check_length(len(prompt_ids), params.max_tokens)
        if rid in self._reserved:
            self._reserved.discard(rid)
        elif self.num_requests >= self.max_requests:
            raise QueueFull(f"{self.num_requests} requests in flight (limit {self.max_requests})")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        try:
            await self.run_on_loop(lambda: self.engine.add(prompt_ids, params, rid, session_id))
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if self._queues.pop(rid, None) is not None and not self._stop.is_set():
                self.call(lambda: self.engine.abort(rid))  # no-op if it already finished

    def abort(self, rid: str) -> concurrent.futures.Future:
        return self.call(lambda: self._abort(rid))

    # -- the loop thread ----------------------------------------------------------------------------

    def _abort(self, rid: str) -> bool:
        out = self.engine.abort(rid)
        if out is not None:
            self._deliver(out)
        return out is not None

    def fail(self, rid: str, error: BaseException) -> None:
        """End a request's stream with an error (loop thread); the request is already out of the engine."""
        entry = self._queues.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, error)

    def _deliver(self, out: StepOutput) -> None:
        if self.on_output is not None:
            self.on_output(out)
            return
        entry = self._queues.get(out.rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _run(self) -> None:
        checked = False  # the integrity check ran since the loop last had work
        idle_since: float | None = None
        last_check = float("-inf")
        try:
            while not self._stop.is_set():
                self.last_progress = time.monotonic()
                while True:
                    try:
                        self._inbox.get_nowait()()
                    except queue.Empty:
                        break
                busy = self.engine.poll()
                busy = (self.poll() if self.poll else False) or busy
                if not self.engine.has_work:
                    now = time.monotonic()
                    if busy or checked:
                        pass
                    elif idle_since is None:
                        idle_since = now
                    elif now - idle_since >= IDLE_CHECK_S and now - last_check >= CHECK_EVERY_S:
                        # idle for a while: check the page pool (engine/state.py; O(pages), so not in
                        # the gaps of a burst, and not more often than CHECK_EVERY_S)
                        self.engine.check_when_idle()
                        checked, last_check = True, now
                    self._wake.wait(0.001 if busy else 0.25)  # transfers in flight: poll every ms
                    self._wake.clear()
                    continue
                checked, idle_since = False, None
                if self.stall_s:
                    time.sleep(self.stall_s)
                for out in self.engine.step():
                    self._deliver(out)
                while self.engine.failures:  # a request's KV source gave up: its stream ends with the error
                    rid, error = self.engine.failures.pop()
                    self.fail(rid, error)
                if self.engine.idle_step:
                    # only parked work: poll fast while a transfer is about to end (busy), else sleep until
                    # a message wakes the loop (a peer's KVDone, a request): polling every 0.5 ms woke the
                    # decode server 2000 times a second through each prefill, on the cores the prefill
                    # server computed on (docs/RESULTS.md, "Sharing the cores")
                    self._wake.wait(0.0005 if busy else PARKED_POLL_S)
                    self._wake.clear()
        except BaseException as e:  # a broken engine must not leave clients waiting forever
            log.exception("engine loop crashed")
            self.error = e
            for loop, q in list(self._queues.values()):
                loop.call_soon_threadsafe(q.put_nowait, RuntimeError(f"engine loop crashed: {e}"))
