"""journald-friendly logging: one event a line on stderr, with a syslog-style <N> level prefix that
journald turns into the entry's priority (SYSLOG_PRIORITY) when stderr goes to the journal."""

from __future__ import annotations

import logging
import os
import sys
import time

# A deployment's roles come up together: a peer not answering yet within this long of the start is info
# (Failures grace_s), not an ERROR on every healthy start.
PEER_START_GRACE_S = 120.0
MAX_MESSAGE_CHARS = 4096  # one log message (a traceback comes after it, whole)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


ROLE_ENV = "TRND_LOG_ROLE"  # the role tag a supervisor gives its children (prefill0, decode, router...)


class _Formatter(logging.Formatter):
    """One format for every trnd process: time, level, [role], logger: message (journald: <N>[role] ...)."""

    def __init__(self, journal: bool, role: str | None = None):
        super().__init__()
        self.journal = journal
        self.tag = f"[{role}] " if role else ""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if len(msg) > MAX_MESSAGE_CHARS:  # a client's string quoted whole (a 1 MB field) must not flood the journal
            msg = f"{msg[:MAX_MESSAGE_CHARS]}... (message cut: {len(msg)} characters)"
        if record.exc_info:
            msg += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        msg = msg.replace("\n", " | ")
        if self.journal:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{self.tag}{record.name}: {msg}"
        return f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {self.tag}{record.name}: {msg}"


def journal_prefix(priority: int) -> str:
    """`<N>` when stderr is the journal, for lines written before (or without) logging: a one-line
    start-up error must reach `journalctl -p err`, not land at the stream's default (info)."""
    return f"<{priority}>" if os.environ.get("JOURNAL_STREAM") else ""


def setup_logging(level: str = "info", role: str | None = None) -> None:
    """Every trnd process logs through here: `role` tags its lines (a supervisor's child: $TRND_LOG_ROLE)."""
    journal = bool(os.environ.get("JOURNAL_STREAM"))  # set by systemd when stderr is the journal
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(journal, os.environ.get(ROLE_ENV) or role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    adopt_nixl_logging()


def adopt_nixl_logging() -> None:
    """NIXL's Python logger ("nixl") writes to stdout in a format of its own once `nixl._api` is imported:
    its lines go through ours instead (one format, the role's tag), its warnings and errors only."""
    nixl = logging.getLogger("nixl")
    nixl.handlers.clear()
    nixl.propagate = True
    nixl.setLevel(max(logging.WARNING, logging.getLogger().level))


class Failures:
    """A peer that keeps failing, logged for an operator rather than at every retry (as vLLM's and
    Dynamo's connectors do): the first failure at `level` (error), a new kind of failure at `level`
    again, the same one repeated as a warning with its count at growing intervals (REPEAT_S, then x3
    up to REPEAT_MAX_S), and one info line when it works again (`recovered`). With `grace_s`, a peer that has
    never answered is only starting (the roles of a deployment come up together): info until then."""

    REPEAT_S = 10.0
    REPEAT_MAX_S = 600.0

    def __init__(self, logger: logging.Logger, what: str, level: int = logging.ERROR, grace_s: float = 0.0):
        self.log, self.what, self.level = logger, what, level
        self.count, self.since, self.last_why = 0, 0.0, None
        self.logged, self.interval, self.next_at = 0, self.REPEAT_S, 0.0
        self.grace_until = time.monotonic() + grace_s if grace_s else float("-inf")
        self.ever_ok = False
        self.quiet = False  # the line of this failure went out at info (in the grace): the next is a first one

    def failed(self, why: str, now: float | None = None, absent: bool = True) -> None:
        """absent: the peer did not answer (what a peer not up yet does); False: it answered and refused,
        which no grace covers."""
        now = time.monotonic() if now is None else now
        if self.count == 0:
            self.since = now
        self.count += 1
        starting = absent and not self.ever_ok and now < self.grace_until
        if why != self.last_why or (self.quiet and not starting):
            self.log.log(logging.INFO if starting else self.level, "%s: %s%s", self.what, why,
                         " (not up yet: retrying)" if starting else "")
            self.last_why, self.logged, self.interval, self.next_at = why, self.count, self.REPEAT_S, now + self.REPEAT_S
            self.quiet = starting
        elif now >= self.next_at:
            self.log.log(logging.INFO if starting else logging.WARNING, "%s: still failing, %d attempts in %.0f s "
                         "(%d since the last line): %s", self.what, self.count, now - self.since,
                         self.count - self.logged, why)
            self.logged = self.count
            self.interval = min(self.interval * 3, self.REPEAT_MAX_S)
            self.next_at = now + self.interval

    def recovered(self, now: float | None = None) -> str | None:
        """The failures are over: " after N failed attempts over T s" for the caller's info line (None if
        there were none); the next failure is a first one again."""
        self.ever_ok = True
        if not self.count:
            return None
        now = time.monotonic() if now is None else now
        text = f" after {self.count} failed attempts over {now - self.since:.0f} s"
        self.count, self.last_why = 0, None
        return text
