"""trnd as a systemd service: the unit files (systemd-analyze verify and security), sysusers/tmpfiles,
the example configs, and the sd_notify lifecycle end to end against a real AF_UNIX datagram socket
(systemd is not PID 1 here): READY only when /ready is 200, watchdog pings that stop when the engine
loop hangs, SIGHUP reload, SIGTERM drain, exit 78 on a bad config."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from trnd.config import (ConfigError, DecodeConfig, LocalConfig, PrefillConfig, RouterConfig, ServeConfig, StoreConfig,
                         load_config)
from trnd.daemon import lifecycle, notify

from .procs import free_port

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "systemd"
UNIT = SYSTEMD / "trnd@.service"
EXPOSURE_TARGET = 2.0  # docs/DEPLOY.md: systemd-analyze security exposure of trnd@.service must stay at or below


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (apt-get install -y --no-install-recommends systemd)")
    return path


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


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min|h)?", value)
    assert m, value
    return float(m[1]) * {"ms": 1e-3, None: 1, "s": 1, "min": 60, "h": 3600}[m[2]]


# -- the unit files ---------------------------------------------------------------------------------

def test_unit_files_verify_without_a_single_message(tmp_path):
    need("systemd-analyze")
    system = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)
    if system is None:
        pytest.skip("no systemd unit directory to verify against")
    # An alternate root with the distribution's units (for sysinit.target and friends), our units in
    # /etc/systemd/system and stand-ins for the two commands the unit runs, which verify checks exist.
    root = tmp_path / "root"
    shutil.copytree(system, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name in ("trnd@.service", "trnd.target"):
        shutil.copy(SYSTEMD / name, etc / name)
    for exe in ("usr/bin/trnd", "bin/kill"):
        (root / exe).parent.mkdir(parents=True, exist_ok=True)
        (root / exe).write_text("#!/bin/sh\n")
        (root / exe).chmod(0o755)
    r = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "--man=no", "trnd@serve.service",
                        "trnd@prefill.service", "trnd@decode.service", "trnd.target"],
                       capture_output=True, text=True, timeout=120)
    assert r.stderr == "" and r.returncode == 0, r.stderr


def test_unit_security_exposure_is_below_target():
    need("systemd-analyze")
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(UNIT)], capture_output=True, text=True,
                       timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m[1]) <= EXPOSURE_TARGET, r.stdout
    assert m[2] in ("PERFECT", "SAFE", "OK"), r.stdout


def test_unit_contract():
    u = unit_settings()
    assert u["Type"] == ["notify"] and u["NotifyAccess"] == ["main"]
    assert u["ExecStart"] == ["/usr/bin/trnd %i --config /etc/trnd/%i.toml"]
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert u["Restart"] == ["on-failure"] and u["RestartPreventExitStatus"] == ["69 78"]
    assert u["KillMode"] == ["mixed"]
    # The drain must fit in the stop timeout with room to abort and close the ranks.
    assert seconds(u["TimeoutStopSec"][0]) >= ServeConfig().http.drain_timeout_s + lifecycle.STOP_MARGIN_S
    assert seconds(u["WatchdogSec"][0]) >= 10
    assert "TRND_CACHE_DIR=/var/cache/trnd" in " ".join(u["Environment"]).split()
    assert u["User"] == ["trnd"] and u["CapabilityBoundingSet"] == [""] and u["NoNewPrivileges"] == ["yes"]
    assert u["DevicePolicy"] == ["closed"] and "PrivateDevices" not in u
    assert u["PartOf"] == ["trnd.target"] and u["WantedBy"] == ["trnd.target"]
    assert any(v.startswith("trnd:/etc/trnd/credentials") for v in u["LoadCredential"])


def test_sysusers_and_tmpfiles_make_the_account_and_directories(tmp_path):
    need("systemd-sysusers")
    need("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("tmpfiles needs root to hand directories to the trnd user")
    (tmp_path / "etc").mkdir()
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSTEMD / "trnd.sysusers")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    user = next(line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
                if line.startswith("trnd:"))
    assert user[5] == "/var/lib/trnd" and user[6].endswith("nologin")
    r = subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(SYSTEMD / "trnd.tmpfiles")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    uid = int(user[2])
    for path, mode, owner in (("etc/trnd/credentials", 0o700, 0), ("var/lib/trnd", 0o750, uid),
                              ("var/cache/trnd", 0o750, uid)):
        st = (tmp_path / path).stat()
        assert (st.st_mode & 0o777, st.st_uid) == (mode, owner), path


@pytest.mark.parametrize("name,cls", [("serve", LocalConfig), ("prefill", PrefillConfig), ("decode", DecodeConfig),
                                      ("router", RouterConfig), ("store", StoreConfig)])
def test_example_role_configs_are_valid(name, cls):
    cfg = load_config(cls, ROOT / "configs" / f"{name}.toml")
    if name not in ("serve", "router"):
        assert cfg.secret_file == "${CREDENTIALS_DIRECTORY}/trnd_control_secret"  # what LoadCredential= names it


# -- the notify protocol, in process ----------------------------------------------------------------

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


@pytest.fixture
def listener():
    li = Listener()
    yield li
    li.close()


def test_notify_is_a_no_op_without_a_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    assert not notify.ready("x") and not notify.watchdog() and not notify.enabled()
    assert notify.watchdog_interval() is None


def test_notify_messages_and_abstract_namespace(monkeypatch):
    li = Listener(f"@trnd-test-{uuid.uuid4().hex}")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", li.address)
        assert notify.ready("serving\nnow")
        assert notify.extend_timeout(1.5)
        assert notify.reloading()
        t_reload = time.clock_gettime(time.CLOCK_MONOTONIC)
        assert notify.stopping("bye")
        li.wait("STOPPING", "1", timeout=5)
        msgs = [m for _, m in li.messages]
        assert msgs[0] == {"READY": "1", "STATUS": "serving now"}
        assert msgs[1] == {"EXTEND_TIMEOUT_USEC": "1500000"}
        assert msgs[2]["RELOADING"] == "1" and abs(int(msgs[2]["MONOTONIC_USEC"]) / 1e6 - t_reload) < 1.0
        assert msgs[3] == {"STOPPING": "1", "STATUS": "bye"}
    finally:
        li.close()


def test_the_supervisors_listener_names_each_senders_pid(tmp_path, monkeypatch):
    """notify.Listener (what trnd serve reads its children with): the kernel's pid for every datagram,
    so a message is the child's own, whoever else can reach the socket."""
    li = notify.Listener(str(tmp_path / "n"))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", li.path)
        assert notify.ready("up", ["127.0.0.1:9"])
        child = subprocess.Popen([sys.executable, "-c", "from trnd.daemon import notify; notify.watchdog()"],
                                 env={**os.environ, "NOTIFY_SOCKET": li.path}, cwd=ROOT)
        assert child.wait(60) == 0
        got = wait_for_messages(li, 2)
        assert got[0] == (os.getpid(), {"READY": "1", "X_TRND_LISTEN": "127.0.0.1:9", "STATUS": "up"})
        assert got[1] == (child.pid, {"WATCHDOG": "1"})
        assert li.receive() == []  # never blocks
    finally:
        li.close()


def wait_for_messages(li, n: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += li.receive()
        time.sleep(0.02)
    return got


def test_watchdog_interval_honours_watchdog_pid(monkeypatch, listener):
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert notify.watchdog_interval() == 2.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert notify.watchdog_interval() is None


def test_heartbeat_feeds_the_watchdog_only_while_the_loop_moves(monkeypatch, listener):
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    life = lifecycle.Lifecycle("serve", ServeConfig(), reload_source=lambda: ServeConfig())
    t0 = time.monotonic()
    life.beat()  # loading: extend the start timeout, and the process is all there is to watch
    _, m = listener.wait("EXTEND_TIMEOUT_USEC", timeout=5)
    listener.wait("WATCHDOG", after=t0, timeout=5)
    life.loop = SimpleNamespace(last_progress=time.monotonic(), error=None)
    life.phase = "running"
    t1 = time.monotonic()
    life.beat()
    listener.wait("WATCHDOG", after=t1, timeout=5)
    assert not listener.times("EXTEND_TIMEOUT_USEC", t1, time.monotonic() + 1)  # running: no more extensions
    life.loop.last_progress = time.monotonic() - 2.5  # stuck for longer than one watchdog period
    t2 = time.monotonic()
    life.beat()
    life.loop.last_progress, life.loop.error = time.monotonic(), RuntimeError("crashed")
    life.beat()
    time.sleep(0.3)
    assert not listener.times("WATCHDOG", t2, time.monotonic())


def test_reload_swaps_limits_and_api_key_and_ignores_the_rest(tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    from trnd.api.server import build_app

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    key = tmp_path / "key"
    key.write_text("old-key\n")
    cfg = load_config(ServeConfig, None, {"api_key_file": str(key), "max_n": 4, "port": 8000})
    loop = SimpleNamespace(max_requests=cfg.api.max_requests)
    app = build_app(loop, cfg, "m")
    new = {}
    life = lifecycle.Lifecycle("serve", cfg, reload_source=lambda: load_config(ServeConfig, None, new))
    life.state, life.loop, life.phase = app.state.trnd, loop, "running"
    client = TestClient(app)

    def status(k: str) -> int:
        return client.get("/no-such-path", headers={"Authorization": f"Bearer {k}"}).status_code

    assert (status("old-key"), status("new-key")) == (404, 401)
    key.write_text("new-key\n")
    new.update(api_key_file=str(key), max_n=2, max_requests=7, port=9000, log_level="info")
    assert life.reload()
    st = app.state.trnd
    assert st.cfg.api.max_n == 2 and loop.max_requests == 7 and life.cfg.api.max_n == 2
    assert st.cfg.http.port == 8000 and life.cfg.http.port == 8000  # needs a restart: ignored
    assert (status("old-key"), status("new-key")) == (401, 404)
    new.update(max_n=3, api_key_file=str(tmp_path / "missing"))
    assert not life.reload()  # the key file is gone: nothing changes, not even max_n
    assert st.cfg.api.max_n == 2 and status("new-key") == 404

    def bad():
        raise ConfigError("x.toml: Expected `int` - at `$.max_n`")
    life.reload_source = bad
    assert not life.reload() and st.cfg.api.max_n == 2


def test_argv_source_rereads_the_file_with_the_same_flags(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text("max_n = 3\nport = 8001\n")
    from trnd.cli import argv_source
    from trnd.config import load_serve_config

    source = argv_source("serve", load_serve_config, ["serve", "--config", str(f), "--port", "8002"])
    f.write_text("max_n = 5\nport = 8001\n")
    cfg = source()
    assert (cfg.api.max_n, cfg.http.port) == (5, 8002)
    assert argv_source("serve", load_serve_config, ["-m", "pytest"]) is None


# -- the daemon, end to end -------------------------------------------------------------------------

def _ppid(p: Path) -> int | None:
    try:
        return int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def exec_start(role: str, config: Path) -> list[str]:
    """The unit's ExecStart for instance `role`, run from this checkout with this interpreter."""
    (line,) = unit_settings()["ExecStart"]
    argv = [a.replace("%i", role) for a in shlex.split(line)]
    assert argv[0] == "/usr/bin/trnd" and argv[-1] == f"/etc/trnd/{role}.toml"
    return [sys.executable, "-m", "trnd", *argv[1:-1], str(config)]


class Daemon:
    def __init__(self, role: str, config: Path, listener: Listener, *extra: str, log: Path,
                 watchdog_s: float | None = 2.0, env: dict | None = None):
        self.listener = listener
        self.log = log
        environ = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "WATCHDOG_PID")}
        environ.update(NOTIFY_SOCKET=listener.address, **(env or {}))
        if watchdog_s:
            environ["WATCHDOG_USEC"] = str(int(watchdog_s * 1e6))
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([*exec_start(role, config), *extra], env=environ, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=ROOT)

    def output(self) -> str:
        return self.log.read_text()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve_config(path: Path, model, port: int, **fields) -> Path:
    data = {"model": str(model), "port": port, "threads": 1, "kv_memory_gb": 0.05, "aggregated": True, **fields}
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items()))
    return path


def wait_ready_notified(d: Daemon, port: int, timeout: float = 90) -> float:
    """Wait for READY=1 while polling /ready; at READY, /ready must already answer 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [t for t, m in list(d.listener.messages) if m.get("READY") == "1"]
        if ready:
            assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200
            return ready[0]
        if d.proc.poll() is not None:
            raise AssertionError(f"exited with {d.proc.returncode} before READY:\n{d.output()}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1)
        except httpx.HTTPError:
            pass
        time.sleep(0.03)
    raise AssertionError(f"no READY=1 within {timeout} s:\n{d.output()}")


def complete(port: int, **body) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"prompt": "hello there", "max_tokens": 1, "temperature": 0, **body}, timeout=30)


def test_serve_ready_watchdog_and_reload(tiny_qwen3, tmp_path, listener):
    port = free_port()
    cfg = serve_config(tmp_path / "serve.toml", tiny_qwen3, port, max_n=4, log_level="info")
    d = Daemon("serve", cfg, listener, log=tmp_path / "out.log", watchdog_s=2.0)
    try:
        t_ready = wait_ready_notified(d, port)
        statuses = [m["STATUS"] for t, m in listener.messages if "STATUS" in m and t < t_ready]
        assert statuses.index("warming up") < statuses.index("starting HTTP")  # READY only after both
        assert listener.times("EXTEND_TIMEOUT_USEC", 0, t_ready)  # the start timeout was extended while loading
        time.sleep(2.6)
        assert len(listener.times("WATCHDOG", t_ready, t_ready + 2.6)) >= 2  # every WATCHDOG_USEC / 2

        assert complete(port, n=3).status_code == 200
        cfg.write_text(cfg.read_text().replace("max_n = 4", "max_n = 2").replace('"info"', '"debug"')
                       .replace(f"port = {port}", f"port = {free_port()}"))
        t_hup = time.monotonic()
        d.signal(signal.SIGHUP)
        t_rel, m = listener.wait("RELOADING", "1", after=t_hup, timeout=10, proc=d.proc)
        assert abs(int(m["MONOTONIC_USEC"]) / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 10
        listener.wait("READY", "1", after=t_rel, timeout=10, proc=d.proc)
        r = complete(port, n=3)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert complete(port, n=2).status_code == 200

        cfg.write_text(cfg.read_text().replace("max_n = 2", 'max_n = "lots"'))  # a bad file changes nothing
        t_hup = time.monotonic()
        d.signal(signal.SIGHUP)
        t_rel, _ = listener.wait("RELOADING", "1", after=t_hup, timeout=10, proc=d.proc)
        _, m = listener.wait("READY", "1", after=t_rel, timeout=10, proc=d.proc)
        assert "reload failed" in m.get("STATUS", "")
        assert complete(port, n=2).status_code == 200 and complete(port, n=3).status_code == 400

        t_term = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.wait() == 0
        listener.wait("STOPPING", "1", after=t_term, timeout=1)
    finally:
        d.kill()
    out = d.output()
    assert "reload #1: config re-read" in out  # a debug line: the new log level took effect
    assert re.search(r"reload: port changed .* needs a restart", out)
    assert "reload failed, keeping the running configuration" in out


def test_sigterm_drains_in_flight_streams_then_aborts_the_rest(tiny_qwen3, tmp_path, listener):
    port = free_port()
    cfg = serve_config(tmp_path / "serve.toml", tiny_qwen3, port, drain_timeout_s=4.0)
    # Every engine step sleeps 50 ms: a 40-token stream takes ~2 s, a 2000-token one far longer.
    d = Daemon("serve", cfg, listener, log=tmp_path / "out.log", env={lifecycle.STALL_ENV: "0.05"})
    results: dict[str, list[dict]] = {}

    def stream(name: str, max_tokens: int, started: threading.Event) -> None:
        events = []
        body = {"prompt": f"tell me about {name}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                    events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
        results[name] = events

    try:
        wait_ready_notified(d, port)
        threads = []
        for name, n in (("short", 40), ("long", 2000)):
            started = threading.Event()
            threads.append(threading.Thread(target=stream, args=(name, n, started), daemon=True))
            threads[-1].start()
            assert started.wait(30)
        t_term = time.monotonic()
        d.signal(signal.SIGTERM)
        listener.wait("STOPPING", "1", after=t_term, timeout=5, proc=d.proc)
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503  # draining
        r = complete(port)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(30)
        assert d.wait() == 0
        assert time.monotonic() - t_term < 4.0 + lifecycle.ABORT_GRACE_S + 5
    finally:
        d.kill()
    short, long = results["short"], results["long"]
    assert short[-1] == {"done": True} and short[-2]["usage"]["completion_tokens"] == 40  # finished in the drain
    assert long[-1] == {"done": True} and "error" in long[-2]  # aborted when drain_timeout_s ran out
    assert long[-2]["error"]["code"] == "unavailable" and "shutting down" in long[-2]["error"]["message"]


def test_a_hung_engine_loop_stops_the_watchdog_pings(tiny_qwen3, tmp_path, listener):
    port = free_port()
    cfg = serve_config(tmp_path / "serve.toml", tiny_qwen3, port)
    d = Daemon("serve", cfg, listener, log=tmp_path / "out.log", watchdog_s=1.0,
               env={lifecycle.STALL_ENV: "60"})
    try:
        t_ready = wait_ready_notified(d, port)
        time.sleep(1.6)
        assert len(listener.times("WATCHDOG", t_ready, time.monotonic())) >= 2  # idle: the loop comes round
        t_req = time.monotonic()

        def request() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server is killed under it
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           timeout=120)

        threading.Thread(target=request, daemon=True).start()
        time.sleep(4.0)
        # One watchdog period (1 s) after the step began, plus a ping period: no ping after that.
        assert not listener.times("WATCHDOG", t_req + 2.0, time.monotonic())
        assert d.proc.poll() is None  # the process lives on; systemd would SIGABRT and restart it
    finally:
        d.kill()


@pytest.mark.parametrize("body,field", [("port = 8000\nmax_nn = 3\n", "max_nn"), ('log_level = "loud"\n', "log_level"),
                                        ("port = 70000\n", "port")])
def test_bad_config_exits_78_with_one_line(tmp_path, body, field):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(body)
    r = subprocess.run(exec_start("serve", cfg), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 78
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trnd: config error:") and field in lines[0], r.stderr


def test_the_one_line_is_at_error_priority_when_stderr_is_the_journal(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text("max_nn = 3\n")
    env = {**os.environ, "JOURNAL_STREAM": "8:12345"}  # what systemd sets when stderr is the journal
    r = subprocess.run(exec_start("serve", cfg), capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 78 and r.stderr.startswith("<3>trnd: config error:") and "max_nn" in r.stderr, r.stderr


def test_role_config_without_its_credential_exits_78(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    r = subprocess.run(exec_start("prefill", ROOT / "configs/prefill.toml"), capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 78
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "trnd_control_secret" in lines[0], r.stderr


@pytest.mark.slow
def test_decode_is_ready_only_after_a_prefill_peer_handshaked(tiny_qwen3, tmp_path):
    secret = tmp_path / "control_secret"
    secret.write_text("test-secret-0123456789")
    control, admin, port = free_port(), free_port(), free_port()
    common = ["--model", str(tiny_qwen3), "--secret-file", str(secret), "--threads", "1", "--kv-memory-gb", "0.1"]
    dec_l, pre_l = Listener(), Listener()
    dec = Daemon("decode", ROOT / "configs/decode.toml", dec_l, *common, "--port", str(port), "--prefill",
                 f"127.0.0.1:{control}", log=tmp_path / "decode.log")
    pre = None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # HTTP answers (probes) while decode waits for its peer
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        time.sleep(1.0)
        assert not [m for _, m in dec_l.messages if m.get("READY") == "1"]
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503
        assert any(m.get("STATUS", "").startswith("waiting: no prefill peer") for _, m in dec_l.messages)
        pre = Daemon("prefill", ROOT / "configs/prefill.toml", pre_l, *common, "--control-port", str(control),
                     "--admin-port", str(admin), log=tmp_path / "prefill.log")
        wait_ready_notified(pre, admin)
        wait_ready_notified(dec, port)
        r = complete(port, max_tokens=3)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        for daemon in (dec, pre):
            daemon.signal(signal.SIGTERM)
            assert daemon.wait() == 0
        dec_l.wait("STOPPING", "1", timeout=1)
        pre_l.wait("STOPPING", "1", timeout=1)
    finally:
        dec.kill()
        if pre is not None:
            pre.kill()
        dec_l.close()
        pre_l.close()


@pytest.mark.slow
def test_serve_deployment_supervisor_speaks_for_its_children(tiny_qwen3, tmp_path, listener):
    """`trnd@serve` with the default local prefill + decode deployment: only the supervisor (the unit's
    main process) notifies: READY once decode is ready, WATCHDOG while both children live, STOPPING."""
    port = free_port()
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'model = "{tiny_qwen3}"\nport = {port}\nthreads = 1\nkv_memory_gb = 0.05\n')
    d = Daemon("serve", cfg, listener, log=tmp_path / "out.log", watchdog_s=2.0)
    try:
        t_ready = wait_ready_notified(d, port, timeout=120)
        time.sleep(2.6)
        assert len(listener.times("WATCHDOG", t_ready, t_ready + 2.6)) >= 2
        assert complete(port).status_code == 200
        # It knows its children: their pids and what each bound, as each child reported it.
        kids = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == d.proc.pid}
        line = next(ln for ln in d.output().splitlines() if "deployment ready:" in ln)
        named = {int(n) for n in re.findall(r"pid (\d+)", line)}
        assert len(named) == 2 and named <= kids, (line, kids)
        assert "decode pid" in line and f"127.0.0.1:{port}" in line, line
        # A child whose pings stop (stopped, as a hung engine step would be) stops the deployment's.
        prefill_pid = int(re.search(r"prefill0 pid (\d+)", line)[1])
        os.kill(prefill_pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            time.sleep(6.0)
        finally:
            os.kill(prefill_pid, signal.SIGCONT)
        assert not listener.times("WATCHDOG", t_stop + 3.5, t_stop + 6.0), "pings went on for a stopped child"
        assert "prefill0 sent no watchdog ping" in d.output()
        t_cont = time.monotonic()
        listener.wait("WATCHDOG", "1", after=t_cont, timeout=10)  # and resume with it
        t_term = time.monotonic()
        d.signal(signal.SIGTERM)
        assert d.wait(60) == 0
        listener.wait("STOPPING", "1", after=t_term, timeout=1)
    finally:
        d.kill()
    # one READY: the children were given no NOTIFY_SOCKET, or each would have sent its own
    assert len([m for _, m in listener.messages if m.get("READY") == "1"]) == 1, d.output()
