"""sd_notify(3) without libsystemd: one datagram of `KEY=VALUE` lines to $NOTIFY_SOCKET.

The protocol is small enough that a dependency would cost more than it saves: the socket is an
AF_UNIX datagram socket, in the abstract namespace when the address starts with '@'. Every call is
a no-op returning False when NOTIFY_SOCKET is unset (not under systemd), so roles call these freely.
"""

from __future__ import annotations

import os
import socket
import struct
import time

__all__ = ["notify", "ready", "status", "extend_timeout", "watchdog", "stopping", "reloading",
           "watchdog_interval", "enabled", "Listener"]


LISTEN = "X_TRND_LISTEN"  # sd_notify(3): fields of one's own start with X_


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


def ready(text: str | None = None, listening: list[str] | None = None) -> bool:
    """The service is up: systemd's start job completes, units ordered after it start. listening: the
    host:port it serves on, as X_TRND_LISTEN (systemd ignores X_ fields; trnd serve's supervisor reads it)."""
    extra = [f"{LISTEN}={' '.join(listening)}"] if listening else []
    return notify(*_with_status(["READY=1", *extra], text))


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


class Listener:
    """The receiving end, for a process that supervises roles (trnd serve, roles/local.py): an AF_UNIX
    datagram socket at `path` (in a directory only this user can enter) whose every datagram comes with
    the sender's pid from the kernel (SO_PASSCRED), so a supervisor can tell its own children's
    messages from anyone else's."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        self.sock.bind(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)

    def receive(self) -> list[tuple[int | None, dict[str, str]]]:
        """Every datagram waiting now, as (sender pid, {key: value}); never blocks."""
        out = []
        creds = struct.calcsize("3i")  # struct ucred: pid, uid, gid
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(creds))
            except (BlockingIOError, InterruptedError):
                return out
            pid = next((struct.unpack("3i", d[:creds])[0] for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            fields = dict(line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line)
            out.append((pid, fields))

    def close(self) -> None:
        self.sock.close()
