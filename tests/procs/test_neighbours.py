"""A hung or hostile neighbour (issue 56), with real processes: a role stopped while it holds the node's core
lock costs the others one missed turn, not one per pass; a local deployment keeps its lock path across
SIGHUP (and a restarted role shares it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from trnd.engine.corelock import STAMP, process_state

from tests.launch import children, free_port, stop, wait_for, wait_ready
from tests.launch import Server


def tokens_time(url: str, n: int, prompt: str = "hello") -> float:
    """Seconds from a stream's first token to its last (the first token's wait excluded)."""
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300,
                      json={"prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.monotonic())
    assert len(stamps) > n // 2
    return stamps[-1] - stamps[0]


def holder_pid(lock: str) -> int:
    with open(lock, "rb") as f:
        raw = f.read(STAMP.size)
    return STAMP.unpack(raw)[0] if len(raw) == STAMP.size else 0


def stopped(pid: int) -> bool:
    """Every thread of pid has stopped (a SIGSTOP reaches the threads one by one)."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return all(process_state(int(t)) in ("T", "t") for t in tasks)


@pytest.mark.slow
def test_a_stopped_lock_holder_costs_the_other_role_one_turn(tiny_qwen3, tmp_path):
    """Two servers take turns on the cores; one is SIGSTOPped while it holds the lock. The other's token gaps
    (the first token's wait aside) take at most a small factor of its own time before: before, every pass
    waited the lock's 2 s deadline."""
    lock = str(tmp_path / "cores.lock")
    a = Server(tiny_qwen3, tmp_path, "--aggregated", config={"core_lock": lock})
    b = Server(tiny_qwen3, tmp_path, "--aggregated", config={"core_lock": lock})
    try:
        before = tokens_time(b.url, 64)
        stream = subprocess.Popen([sys.executable, "-c", f"""
import httpx
with httpx.stream("POST", "{a.url}/v1/completions", timeout=600, json={{"prompt": "x", "max_tokens": 500,
                  "stream": True, "ignore_eos": True}}) as r:
    for _ in r.iter_lines():
        pass
"""])
        try:
            for _ in range(6000):  # stop it while it holds the lock (its stamp names it only while it does)
                if holder_pid(lock) == a.proc.pid:
                    a.proc.send_signal(signal.SIGSTOP)  # delivered asynchronously: look once it has stopped
                    wait_for(lambda: stopped(a.proc.pid), timeout=5, interval=0.001)
                    if holder_pid(lock) == a.proc.pid:
                        break
                    a.proc.send_signal(signal.SIGCONT)
                time.sleep(0.005)
            else:
                pytest.fail("the streaming server never held the lock")
            during = tokens_time(b.url, 64)
        finally:
            a.proc.send_signal(signal.SIGCONT)
            stream.kill()
            stream.wait()
        assert during / before < 5, (before, during)
        assert "computing without it until it lets go" in b.log()
    finally:
        a.stop()
        b.stop()


def _child_configs(pid: int) -> dict[str, dict]:
    """The local deployment's children: role -> (its config's values), from their command lines."""
    import tomllib

    out = {}
    for kid in children(pid):
        argv = open(f"/proc/{kid}/cmdline").read().split("\0")
        if "--config" in argv:
            path = argv[argv.index("--config") + 1]
            out[argv[argv.index("-m") + 2]] = {"pid": kid, **tomllib.loads(open(path).read())}
    return out


def _open_lock(pid: int) -> str | None:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith("cores.lock"):
            return target
    return None


@pytest.mark.slow
def test_the_core_lock_path_is_kept_across_sighup_and_a_restart(tiny_qwen3, tmp_path):
    """SIGHUP with an unchanged config reports nothing to restart (before: `core_lock changed ... needs a
    restart`, a new reload/ path in the children's files), and a role the supervisor restarts afterwards
    opens the same lock file as the one that kept running."""
    port = free_port()
    cfg = tmp_path / "serve.toml"
    cfg.write_text('max_requests = 64\n')
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--port", str(port),
                             "--config", str(cfg), "--threads", "1", "--kv-memory-gb", "0.25"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(port, proc, timeout=180)
        kids = _child_configs(proc.pid)
        lock = kids["decode"]["core_lock"]
        assert kids["prefill"]["core_lock"] == lock and _open_lock(kids["decode"]["pid"]) == lock
        proc.send_signal(signal.SIGHUP)
        time.sleep(3)
        assert {r: c["core_lock"] for r, c in _child_configs(proc.pid).items()} == {"prefill": lock, "decode": lock}
        os.kill(kids["prefill"]["pid"], signal.SIGKILL)  # the supervisor restarts it, from its (reloaded) file
        new = wait_for(lambda: (c := _child_configs(proc.pid).get("prefill")) and c["pid"] != kids["prefill"]["pid"]
                       and _open_lock(c["pid"]), timeout=120)
    finally:
        out = stop(proc)
    assert new == lock, out
    assert "needs a restart" not in out, out
