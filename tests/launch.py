"""Helpers for tests that start real trnd processes on loopback: ports, `trnd serve` and the roles, a
wait until ready (trnd/procs.py's, stopping what does not come up), and a notify socket standing in for
systemd's."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from trnd import procs
from trnd.procs import free_port  # noqa: F401  (tests import it from here)

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "trnd@.service"
MAX_MODEL_LEN = 512

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
    """trnd/procs.py's wait for one test process, with what it printed on failure; one that is not ready in
    time is stopped first (a caller that raises from here has no handle left to stop it with)."""
    try:
        procs.wait_ready(port, [proc], timeout, path)
    except RuntimeError as e:
        raise RuntimeError(f"{e}:\n{proc.stdout.read() if proc.stdout else ''}") from None
    except TimeoutError as e:
        out = stop(proc)
        raise TimeoutError(f"{e} (stopped):\n{out[-4000:]}") from None


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


def start_store(secret, memory_gb=0.05) -> tuple[subprocess.Popen, int, int]:
    cp, ap = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "store", "--secret-file", str(secret), "--control-port",
                             str(cp), "--admin-port", str(ap), "--memory-gb", str(memory_gb)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_ready(ap, proc)
    return proc, cp, ap


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


class Server:
    """A `trnd serve` subprocess on a free port; `url` is its root (no /v1)."""

    def __init__(self, model_dir, tmp_dir: Path, *args: str, config: dict | None = None, api_key: str | None = None,
                 max_model_len: int = MAX_MODEL_LEN):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "trnd", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--host", "127.0.0.1", "--threads", "1", "--kv-memory-gb", "0.05",
               "--max-model-len", str(max_model_len), "--log-level", "warning", *args]
        if config:
            path = tmp_dir / f"serve-{self.port}.toml"
            path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
            cmd += ["--config", str(path)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = tmp_dir / f"serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            procs.wait_ready(self.port, [self.proc], 180.0, output=self.log)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def state(self) -> dict:
        r = httpx.get(f"{self.url}/admin/state", headers=self.headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """Poll /admin/state until no request runs, waits or holds pages; returns that state."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if not s["running"] and not s["waiting"] and s["pages"]["in_use"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {s['running']} {s['waiting']} {s['pages']}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Listener:
    """A stand-in for systemd's notify socket: collects (monotonic time, {key: value}) per datagram."""

    def __init__(self, address: str | None = None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if address is None:
            self.dir = tempfile.mkdtemp(prefix="trnd-sd-")  # short: AF_UNIX paths stop at 108 bytes
            address = os.path.join(self.dir, "notify")
        self.address = address
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                data = self.sock.recv(65536)
            except (socket.timeout, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append((time.monotonic(), fields))

    def wait(self, key: str, value: str | None = None, after: float = 0.0, timeout: float = 60.0,
             proc: subprocess.Popen | None = None) -> tuple[float, dict[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, m in list(self.messages):
                if t >= after and key in m and (value is None or m[key] == value):
                    return t, m
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"exited with {proc.returncode} while waiting for {key}")
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} within {timeout} s; got {[m for _, m in self.messages]}")

    def times(self, key: str, start: float, end: float) -> list[float]:
        return [t for t, m in list(self.messages) if key in m and start <= t < end]

    def close(self) -> None:
        self._done.set()
        self._thread.join()
        self.sock.close()
        if self.address.startswith("/"):
            shutil.rmtree(os.path.dirname(self.address), ignore_errors=True)


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """Key -> values (a key may repeat) of a unit file, across sections."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out
