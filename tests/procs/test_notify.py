"""The sd_notify protocol in process, against a real AF_UNIX datagram socket standing in for systemd:
messages, the supervisor's listener, the watchdog interval, and the heartbeat that feeds it only while
the loop moves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace


from trnd.config import ServeConfig
from trnd.daemon import lifecycle, notify

from tests.launch import REPO, Listener


# -- the notify protocol, in process ----------------------------------------------------------------

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
                                 env={**os.environ, "NOTIFY_SOCKET": li.path}, cwd=REPO)
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


