"""The daemon end to end (systemd is not PID 1 here): `trnd serve` and the roles under a notify socket,
READY only when /ready is 200, watchdog pings that stop when the engine loop hangs, SIGHUP reload,
SIGTERM drain, exit 78 on a bad config, the supervisor speaking for its children."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from trnd.daemon import lifecycle

from tests.launch import Listener, free_port, unit_settings


ROOT = Path(__file__).resolve().parents[2]


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
    """Under systemd ($CREDENTIALS_DIRECTORY set) without the unit's credential: one line naming it. (Outside
    systemd the same config uses this host's own secret: tests/procs/test_dropin_cli.py.)"""
    creds = tmp_path / "credentials"
    creds.mkdir()
    env = {**os.environ, "CREDENTIALS_DIRECTORY": str(creds), "TRND_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(exec_start("prefill", ROOT / "configs/prefill.toml"), capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 78
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "trnd_control_secret" in lines[0], r.stderr
    assert not (tmp_path / "cache" / "control_secret").exists()


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
