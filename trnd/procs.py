"""Process plumbing shared by the roles, the benchmarks and the tests: free ports, readiness, the
child's death with its parent, the exit status of a bad configuration."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

EX_CONFIG = 78  # sysexits.h: a bad configuration; systemd units do not restart on it
EX_UNAVAILABLE = 69  # sysexits.h: the backend cannot run on this host (`trnd check` exits so too)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_ready(port: int, path: str = "/ready", timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(port: int, procs: list[subprocess.Popen], timeout: float = 300.0, path: str = "/ready") -> None:
    """Until GET `path` answers 200; raises if one of `procs` exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, p.args))[:200]} exited with {p.returncode} before it was ready")
        if is_ready(port, path, timeout=2.0):
            return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} not ready after {timeout} s")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (a TP rank, or a role before exec): `sig` when its parent dies, even by SIGKILL, so no
    orphan keeps a node's memory or cores (PR_SET_PDEATHSIG; Linux only, nothing elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
