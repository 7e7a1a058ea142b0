"""Process plumbing shared by the roles, the benchmarks and the tests: free ports, binding a role's
ports and dialing a peer's, readiness, the child's death with its parent, the exit status of a bad configuration."""

from __future__ import annotations

import errno
import functools
import random
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

EX_CONFIG = 78  # sysexits.h: a bad configuration; systemd units do not restart on it
EX_UNAVAILABLE = 69  # sysexits.h: the backend cannot run on this host (`trnd check` exits so too)


class PortError(RuntimeError):
    """A role's port cannot be had: one line naming the field and the port. `exit_code` 1 when a restart
    may fix it (another process holds it, the address is not up yet), 78 when it cannot (no permission)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def bind_port(host: str, port: int, field: str = "port") -> socket.socket:
    """Bind a role's TCP port now, at start, but do not listen yet: a port another process holds fails
    in a second, not after the model has loaded, and connections are refused (not queued) until
    serving starts. asyncio's create_server(sock=...) listens on it then. SO_REUSEADDR as asyncio sets
    it: the restarted role is not held off by its predecessor's TIME_WAIT connections, while a socket
    already listening there still refuses the bind."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise PortError(f"{field} = {port}: host {host!r} does not resolve: {e.strerror}", EX_CONFIG) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        where = f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise PortError(f"{field} = {port}: {where} is already in use by another process", 1) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise PortError(f"{field} = {port}: {host!r} is not an address of this host (yet)", 1) from None
        code = EX_CONFIG if e.errno == errno.EACCES else 1
        raise PortError(f"{field} = {port}: cannot bind {where}: {e.strerror}", code) from None
    sock.setblocking(False)
    return sock


async def dial(host: str, port: int, timeout: float, local_addr: tuple[str, int] | None = None):
    """Open a control connection, refusing one that reached itself. Dialing a local port nobody listens
    on can pick that very port as the source (TCP simultaneous open): the connection "succeeds", waits
    for a Challenge nobody sends, and holds the port, so the peer starting there cannot bind it. It is
    reset, not closed: a closed one would hold the port in TIME_WAIT for a minute."""
    import asyncio

    async with asyncio.timeout(timeout):  # not wait_for: it can lose a cancellation (trnd/aio.py)
        reader, writer = await asyncio.open_connection(host, port, local_addr=local_addr)
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.getsockname() == sock.getpeername():
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset: no TIME_WAIT left holding the port
        raise ConnectionRefusedError(f"{host}:{port}: connected to itself (nobody listens there)")
    return reader, writer


def check_listening(server, where: str) -> None:
    """Raise PortError unless every socket of an asyncio server made from a bind_port socket listens.
    Two sockets with SO_REUSEADDR may both bind a port while neither listens; the one that listens
    second fails, and uvloop's create_server(sock=...) does not raise then: it returns a server with no
    socket, and the role would run on serving nothing (seen: a decode server whose port another role
    took while it loaded)."""
    socks = list(getattr(server, "sockets", None) or ()) or [None]
    if any(s is None or not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) for s in socks):
        raise PortError(f"{where}: another process started listening there while this role loaded "
                        "(listen failed: address in use)", 1)


async def start_checked_server(on_conn, sock: socket.socket):
    """asyncio.start_server on a bind_port socket (a control port), then check_listening."""
    import asyncio

    host, port = sock.getsockname()[:2]  # read before the server takes the socket over
    server = await asyncio.start_server(on_conn, sock=sock)
    check_listening(server, f"control port {host}:{port}")
    return server


_handed_out: set[int] = set()
_rng = random.SystemRandom()  # not the random module's state, which a forked child shares with its parent


@functools.cache
def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port free now that this process has not handed out before, for a child to bind soon.

    Drawn at random below the kernel's ephemeral range where that range leaves room: a port the kernel hands
    out (bind to 0, an outgoing connection, a NIXL or gloo listener) never comes from there, so none of them
    can take it before the child binds it. That happened: a port picked by binding to 0 was another process's
    when the test's server started. Not handing a port out twice matters too: callers take several before the
    children that bind them start, and a decode server given its prefill's admin port lost it to the prefill,
    whose /ready then answered for it."""
    top = _ephemeral_start()
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", _rng.randrange(10000, top) if top > 12000 else 0))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(errno.EADDRINUSE, "no free loopback port found in 200 tries")


def is_ready(port: int, path: str = "/ready", timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(port: int, procs: list[subprocess.Popen], timeout: float = 300.0, path: str = "/ready",
               output: Callable[[], str] | None = None, interval: float = 0.2) -> float:
    """Until GET `path` on loopback answers 200; returns the seconds it took. Raises RuntimeError if one of
    `procs` exits first, TimeoutError after `timeout`; either message ends with `output()` (what the
    process wrote) when given. The one wait the benchmarks, the tests and their helpers share."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    tail = (lambda: f":\n{output()}") if output is not None else (lambda: "")
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, p.args))[:200]} exited with {p.returncode} before it was "
                                   f"ready{tail()}")
        if is_ready(port, path, timeout=2.0):
            return time.monotonic() - t0
        time.sleep(interval)
    raise TimeoutError(f"port {port} not ready after {timeout} s{tail()}")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (a TP rank, or a role before exec): `sig` when its parent dies, even by SIGKILL, so no
    orphan keeps a node's memory or cores (PR_SET_PDEATHSIG; Linux only, nothing elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
