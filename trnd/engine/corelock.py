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

A holder that does not let go costs one missed turn, not one per pass: each holder stamps the file with its
pid and a turn number as it takes the lock (one pwrite), and a waiter that gave up on a turn takes the cores
without waiting while that same turn still holds the lock (a SIGSTOPped or hung role: before, every forward
pass of the others waited the deadline, one token per 2-4 s). The stamp is read only when the lock is
contended. A lease the holder must renew would need a thread writing it from inside every long pass; the
turn stamp needs nothing of a holder that has stopped (docs/DEPLOY.md, "Sharing the cores").
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import struct
import threading
import time
from contextlib import contextmanager

from trnd.config import StartupError

log = logging.getLogger("trnd.engine")

STAMP = struct.Struct("<IQ")  # the holder's pid, its turn number: the first bytes of the lock file
_turns = itertools.count(1)  # one sequence per process: two locks in one process never stamp the same turn


def process_state(pid: int) -> str:
    """/proc's one-letter state of pid (R running, S sleeping, T stopped, ...); "gone" where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


class CoreLock:
    def __init__(self, path: str, deadline_s: float = 2.0):
        self.path, self.deadline_s = path, deadline_s
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:  # a role that cannot share the cores as configured does not start
            raise StartupError(f"core_lock = {path!r}: {e.strerror}") from None
        self.waited_s = 0.0  # time this role spent waiting for the others (metrics: core_lock_wait_seconds)
        self.overruns = 0  # passes computed without the lock (a wait that hit the deadline, or a turn given up on)
        self.give_ups = 0  # waits that hit the deadline
        self._mu = threading.Lock()
        self._ask = threading.Semaphore(0)  # engine -> helper: block until the lock is ours
        self._got = threading.Event()  # helper -> engine: it is
        self._pending = False  # the helper is (or is about to be) blocked in flock
        self._wanted = False  # someone waits for the helper's result (else it lets the lock go)
        self._closed = False
        self._helper: threading.Thread | None = None
        self._given_up: bytes | None = None  # the stamp of the turn this role last gave up waiting on

    def _stamp(self) -> None:
        os.pwrite(self.fd, STAMP.pack(os.getpid() & 0xFFFFFFFF, next(_turns)), 0)

    def holder(self) -> bytes:
        """The stamp of the holder (zeros once it let go; what a killed holder left until the next one)."""
        return os.pread(self.fd, STAMP.size, 0)

    def _holder_lives(self) -> bool:
        """A holder that died left its stamp; the kernel dropped its lock, so a wait now ends at once."""
        return process_state(STAMP.unpack(self._given_up)[0]) not in ("gone", "Z", "X")

    def acquire(self) -> bool:
        """True once held; False after deadline_s without it (the caller computes anyway)."""
        with self._mu:
            if not self._pending:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._stamp()
                    return True
                except BlockingIOError:
                    pass
            if self._given_up is not None and self.holder() == self._given_up and self._holder_lives():
                self.overruns += 1  # the turn this role gave up on still holds it: no second wait
                return False
            if not self._pending:
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
                self._given_up = None
                self._stamp()
                return True
            self._wanted = False
            stamp = self.holder()
            self._given_up = stamp if len(stamp) == STAMP.size and any(stamp) else None
        self.overruns += 1
        self.give_ups += 1
        if self.give_ups == 1 or self.give_ups % 100 == 0:
            pid = STAMP.unpack(stamp)[0] if self._given_up else 0
            log.warning("core lock %s: pid %s (state %s) held it over %.1f s; computing without it until it lets go "
                        "(%d turns given up so far)", self.path, pid or "?", process_state(pid) if pid else "?",
                        self.deadline_s, self.give_ups)
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
        os.pwrite(self.fd, bytes(STAMP.size), 0)  # the stamp names a holder only while one holds the lock
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
