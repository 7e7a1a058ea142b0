"""sd_notify(3) without libsystemd: one datagram of `KEY=VALUE` lines to $NOTIFY_SOCKET.

The protocol is small enough that a dependency would cost more than it saves: the socket is an
AF_UNIX datagram socket, in the abstract namespace when the address starts with '@'. Every call is
a no-op returning False when NOTIFY_SOCKET is unset (not under systemd), so roles call these freely.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["notify", "ready", "status", "extend_timeout", "watchdog", "stopping", "reloading",
           "watchdog_interval", "enabled"]


def _address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock: and anything else: not ours to speak


def enabled() -> bool:
    return bool(os.environ.get("NOTIFY_SOCKET"))


def notify(*fields: str) -> bool:
    """Send `fields` (each `KEY=VALUE`, no newlines in values) as one datagram. True if sent."""
    addr = _address(os.environ.get("NOTIFY_SOCKET", ""))
    if addr is None:
        return False
    msg = "\n".join(f.replace("\n", " ") for f in fields).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(msg, addr)
        except OSError:  # the manager went away (or a test closed its socket): never fatal to serving
            return False
    return True


def _with_status(fields: list[str], text: str | None) -> list[str]:
    return fields + ([f"STATUS={text}"] if text else [])


def ready(text: str | None = None) -> bool:
    """The service is up: systemd's start job completes, units ordered after it start."""
    return notify(*_with_status(["READY=1"], text))


def status(text: str) -> bool:
    """Free-form one-line status shown by `systemctl status`."""
    return notify(f"STATUS={text}")


def extend_timeout(seconds: float) -> bool:
    """Ask for `seconds` more before the current start/stop timeout fires (counted from now)."""
    return notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def stopping(text: str | None = None) -> bool:
    return notify(*_with_status(["STOPPING=1"], text))


def reloading(text: str | None = None) -> bool:
    """Reload starts now. MONOTONIC_USEC (CLOCK_MONOTONIC) lets systemd tell this reload from an older
    one (required by Type=notify-reload, harmless for Type=notify); READY=1 ends it."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(*_with_status(["RELOADING=1", f"MONOTONIC_USEC={usec}"], text))


def watchdog_interval() -> float | None:
    """Seconds between keep-alive pings that systemd expects (WATCHDOG_USEC), or None when the watchdog
    is off or meant for another process (WATCHDOG_PID)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not enabled():
        return None
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 if value > 0 else None
