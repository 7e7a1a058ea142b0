"""Helpers for tests that start real trnd processes on loopback."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from trnd.procs import free_port  # noqa: F401  (tests import it from here)

_held: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port where nothing answers, for a peer that is down: held bound (without SO_REUSEADDR)
    and never listened on, for the life of this test process, so a connect is refused and no other process
    can take it. A port that is merely free now may be bound by the next process that asks, e.g. a role of
    a test on the other `make test` worker, which a role here would then reach as its peer."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _held.append(s)
    return s.getsockname()[1]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (dead for a test's purposes, only not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int | None = None) -> set[int]:
    """The live child processes of pid (default: this test process), of any of its threads."""
    kids = set()
    for path in glob.glob(f"/proc/{pid or os.getpid()}/task/*/children"):
        try:
            kids.update(int(t) for t in open(path).read().split())
        except OSError:  # the thread ended meanwhile
            pass
    return {k for k in kids if alive(k)}


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120.0, path: str = "/ready") -> None:
    """Until `path` answers 200; a process that exits first or is not ready in time raises (the latter is
    stopped first: a caller that raises from here has no handle left to stop it with)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"trnd exited with {proc.returncode} before it was ready:\n{out}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    out = stop(proc)
    raise TimeoutError(f"trnd on port {port} not ready after {timeout} s (stopped):\n{out[-4000:]}")


def start_serve(model_dir, *extra: str, port: int | None = None) -> tuple[subprocess.Popen, int]:
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(model_dir), "--port", str(port),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, port


def start_role(role: str, model_dir, secret_file, *extra: str, **ports) -> subprocess.Popen:
    """`trnd prefill|decode` as a real process. ports: control_port/admin_port (prefill), port (decode)."""
    args = [sys.executable, "-m", "trnd", role, "--model", str(model_dir), "--secret-file", str(secret_file),
            "--threads", "1"]
    for k, v in ports.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args + list(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen, timeout: float = 10) -> str:
    """Terminate (then kill) and return what it printed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read() if proc.stdout else ""


def admin_state(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=10).json()


def wait_for(pred, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def background(fn) -> tuple[threading.Thread, dict]:
    """fn() on a thread: its dict, or {"error": e} where it lost its connection (a server the test kills)."""
    result: dict = {}

    def run():
        try:
            result.update(fn())
        except httpx.TransportError as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result
