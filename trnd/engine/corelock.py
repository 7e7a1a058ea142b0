"""The cores of one node, one role's forward pass at a time.

A local deployment (`trnd serve`: prefill and decode processes on one machine) runs an OpenMP team in
each role on the same cores. Computing at once, the two teams oversubscribe the cores: every barrier of
one waits on a thread the other has preempted, and a spinning worker holds a core the other needs. Taking
turns, each forward pass has every core to itself and can spin between its ops as a role alone does
(GOMP_SPINCOUNT 20000, trnd/__init__.py). Measured on 2 cores (docs/RESULTS.md, "Sharing the cores"):
the pair's output tok/s +28% at c=1, +20% at c=4, +10% at c=16 against computing at once. The aggregated server mixes prefill chunks
into its decode steps for the same reason (engine/scheduler.py).

An flock on a file every role opens: the kernel drops it when a holder dies. Uncontended, the lock is
one non-blocking flock call. Contended, a helper thread blocks in flock (the kernel wakes it the moment
the holder lets go; polling instead woke the waiter hundreds of times a prefill, each wake-up preempting
a worker of the team it waited for) while the engine thread waits for it with a deadline: a role that
waited longer than `deadline_s` (a stopped peer, a very long prefill chunk) computes anyway, so the lock
can only cost time, never stall a role.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from contextlib import contextmanager

from trnd.config import StartupError

log = logging.getLogger("trnd.engine")


class CoreLock:
    def __init__(self, path: str, deadline_s: float = 2.0):
        self.path, self.deadline_s = path, deadline_s
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:  # a role that cannot share the cores as configured does not start
            raise StartupError(f"core_lock = {path!r}: {e.strerror}") from None
        self.waited_s = 0.0  # time this role spent waiting for the others (metrics: core_lock_wait_seconds)
        self.overruns = 0  # waits that hit the deadline and computed without the lock
        self._mu = threading.Lock()
        self._ask = threading.Semaphore(0)  # engine -> helper: block until the lock is ours
        self._got = threading.Event()  # helper -> engine: it is
        self._pending = False  # the helper is (or is about to be) blocked in flock
        self._wanted = False  # someone waits for the helper's result (else it lets the lock go)
        self._closed = False
        self._helper: threading.Thread | None = None

    def acquire(self) -> bool:
        """True once held; False after deadline_s without it (the caller computes anyway)."""
        with self._mu:
            if not self._pending:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    pass
                if self._helper is None:
                    self._helper = threading.Thread(target=self._wait_loop, name="trnd-corelock", daemon=True)
                    self._helper.start()
                self._pending = True
                self._ask.release()
            self._wanted = True  # (a helper still blocked from an earlier, abandoned wait serves this one)
        t0 = time.monotonic()
        self._got.wait(self.deadline_s)
        with self._mu:
            self.waited_s += time.monotonic() - t0
            if self._got.is_set():
                self._got.clear()
                return True
            self._wanted = False
        self.overruns += 1
        if self.overruns == 1 or self.overruns % 100 == 0:
            log.warning("core lock %s: another role held it over %.1f s; computing without it (%d times so "
                        "far)", self.path, self.deadline_s, self.overruns)
        return False

    def _wait_loop(self) -> None:
        while True:
            self._ask.acquire()
            if self._closed:
                return
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # blocks in the kernel, the GIL released
            with self._mu:
                self._pending = False
                if self._closed:  # close() left the descriptor to this thread
                    os.close(self.fd)
                    return
                if self._wanted:
                    self._wanted = False
                    self._got.set()
                    continue
                fcntl.flock(self.fd, fcntl.LOCK_UN)  # the wait was abandoned: not ours to keep

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    @contextmanager
    def held(self):
        got = self.acquire()
        try:
            yield
        finally:
            if got:
                self.release()

    def close(self) -> None:
        with self._mu:
            self._closed = True
            self._ask.release()  # a helper waiting to be asked returns
            if not self._pending:  # else the helper, blocked in flock on it, closes it when it wakes
                os.close(self.fd)
