"""journald-friendly logging: one event a line on stderr, with a syslog-style <N> level prefix that
journald turns into the entry's priority (SYSLOG_PRIORITY) when stderr goes to the journal."""

from __future__ import annotations

import logging
import os
import sys

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _Formatter(logging.Formatter):
    def __init__(self, journal: bool):
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        msg = msg.replace("\n", " | ")
        if self.journal:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{record.name}: {msg}"
        return f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.name}: {msg}"


def journal_prefix(priority: int) -> str:
    """`<N>` when stderr is the journal, for lines written before (or without) logging: a one-line
    start-up error must reach `journalctl -p err`, not land at the stream's default (info)."""
    return f"<{priority}>" if os.environ.get("JOURNAL_STREAM") else ""


def setup_logging(level: str = "info") -> None:
    journal = bool(os.environ.get("JOURNAL_STREAM"))  # set by systemd when stderr is the journal
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(journal))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("uvicorn.access", "NIXL", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
