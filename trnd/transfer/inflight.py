"""NIXL transfers in flight: what was posted, the local pages each one fences until it ends, reaping,
and the warning for one that runs too long.

A posted transfer keeps touching its local pages (prefill's source pages it reads, a store read's
destination pages it writes) until NIXL says it ended, whoever stopped waiting for it: a deadline that
passed, an aborted request. Those pages are fenced (`fenced()`) until `reap()` sees the end; the
owner must not hand them to anyone else before. One owner posts and reaps (prefill's engine thread, the
store client's loop); `fenced()` may be read from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger("trnd.transfer")

STUCK_S = 30.0  # a transfer still running after this is logged once (its pages stay fenced)


@dataclass(eq=False)
class Xfer:
    """One posted NIXL transfer."""
    handle: object
    pages: list[int]  # local pages it reads or writes: fenced until it ends
    nbytes: int
    t0: float
    key: object = None  # the owner's: prefill's local request id, the store client's future
    warned: bool = False


class InFlight:
    def __init__(self, agent, what: str, stuck_s: float = STUCK_S):
        """agent: transfer/nixl.py KVAgent (state, release); what: names the transfers in the stuck warning."""
        self.agent, self.what, self.stuck_s = agent, what, stuck_s
        self.xfers: list[Xfer] = []
        self._fenced: Counter[int] = Counter()
        self._lock = threading.Lock()  # guards _fenced: read from other threads

    def __len__(self) -> int:
        return len(self.xfers)

    def post(self, handle, pages: list[int], nbytes: int, key=None, t0: float | None = None) -> Xfer:
        x = Xfer(handle, list(pages), nbytes, time.monotonic() if t0 is None else t0, key)
        with self._lock:
            self._fenced.update(x.pages)
        self.xfers.append(x)
        return x

    def reap(self, now: float | None = None) -> list[tuple[Xfer, bool]]:
        """Every transfer that ended, (xfer, ok): its handle released, its pages no longer fenced."""
        now = time.monotonic() if now is None else now
        ended, still = [], []
        for x in self.xfers:
            state = self.agent.state(x.handle)
            if state == "PROC":
                still.append(x)
                if not x.warned and now - x.t0 > self.stuck_s:
                    x.warned = True
                    log.warning("a %s transfer has run for %.0f s; its %d pages stay fenced", self.what,
                                self.stuck_s, len(x.pages))
                continue
            self.agent.release(x.handle)
            ended.append((x, state == "DONE"))
        self.xfers = still
        if ended:
            with self._lock:
                self._fenced.subtract(p for x, _ in ended for p in x.pages)
                self._fenced += Counter()  # drop the zeros
        return ended

    def fenced(self) -> set[int]:
        """Local pages an unfinished transfer may still read or write: not to be reused yet."""
        with self._lock:
            return set(self._fenced)

    def of(self, key) -> list[Xfer]:
        return [x for x in self.xfers if x.key == key]

    def cancel_all(self) -> None:
        """At shutdown: NIXL tries to cancel what is still moving."""
        for x in self.xfers:
            self.agent.release(x.handle)
        self.xfers.clear()
        with self._lock:
            self._fenced.clear()
