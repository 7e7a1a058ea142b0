"""`trnd serve` in a terminal, as a user runs it: Ctrl-C (SIGINT to the whole foreground process group, as a
terminal sends it) during start-up and on a loaded deployment, and the log one start writes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.launch import admin_state, free_port, wait_for, wait_ready

pytestmark = pytest.mark.slow


def serve(model, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """`trnd serve` as the leader of its own process group, like a shell's foreground job."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--kv-memory-gb", "0.1", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    return proc, port


def in_server(port: int) -> int:
    s = admin_state(port)
    return len(s.get("running") or []) + len(s.get("waiting") or [])


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def _ctrl_c_after(model, delay: float) -> None:
    proc, _ = serve(model)
    time.sleep(delay)
    ctrl_c(proc)
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its children die with it (PR_SET_PDEATHSIG)
            proc.communicate()
    assert proc.returncode == 130, (delay, proc.returncode, out)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out


KNOWN_LOST_CTRL_C = pytest.mark.xfail(
    strict=False, reason="known defect (issue 51): on a loaded host a Ctrl-C during trnd serve's start-up is "
    "sometimes lost and the deployment keeps running (clean-clone CI 2026-12-08: at 3.0 s, then at 0.5 s); a "
    "deployment ready before the delay drains with exit 0 by design")


@KNOWN_LOST_CTRL_C
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tiny_qwen3):
    _ctrl_c_after(tiny_qwen3, 0.5)  # while Python imports the CLI


@KNOWN_LOST_CTRL_C
def test_ctrl_c_while_the_roles_load_exits_130(tiny_qwen3):
    _ctrl_c_after(tiny_qwen3, 3.0)  # while the roles load


def test_one_ctrl_c_drains_in_order_and_a_second_stops_at_once(tiny_qwen3):
    proc, port = serve(tiny_qwen3, "--log-level", "info")
    try:
        wait_ready(port, proc)
        results: list[object] = []

        def request(n: int) -> None:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                               json={"prompt": "Once upon a time", "max_tokens": n, "ignore_eos": True})
                results.append(r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.status_code)
            except httpx.HTTPError as e:
                results.append(type(e).__name__)

        threads = [threading.Thread(target=request, args=(64,)) for _ in range(3)]
        for t in threads:
            t.start()
        # all three reached the server (running, waiting for their KV, or done): one still connecting when
        # Ctrl-C comes is refused, as it should be
        assert wait_for(lambda: in_server(port) + len(results) >= 3, 60), results
        ctrl_c(proc)  # once: the requests in flight finish
        for t in threads:
            t.join(120)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert results == ["length"] * 3, (results, out)
    assert " again: " not in out and "Traceback" not in out, out  # no second signal reached any role
    decode_done = out.index("[decode]", out.index("draining the deployment"))
    prefill_lines = [m.start() for m in re.finditer(r"\[prefill0\].*(SIGTERM|drain)", out)]
    assert prefill_lines and min(prefill_lines) > decode_done, out  # decode drained first, then prefill

    proc, port = serve(tiny_qwen3, "--log-level", "info")
    try:
        wait_ready(port, proc)
        threads = [threading.Thread(target=request, args=(5000,)) for _ in range(2)]
        results.clear()
        for t in threads:
            t.start()
        time.sleep(1.0)
        ctrl_c(proc)
        time.sleep(0.5)
        t0 = time.monotonic()
        ctrl_c(proc)  # twice: now, without waiting for them
        out, _ = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped_in < 20, (stopped_in, out)
    assert "Traceback" not in out, out
    assert "stopping every role now" in out and len(results) == 2, (results, out)


def test_one_start_one_log(tmp_path):
    """A first start: the preset is made and said so; every line in one format with its role; no ERROR; no line
    twice."""
    proc, port = serve("tiny", "--log-level", "info", env={"TRND_CACHE_DIR": str(tmp_path)})
    try:
        wait_ready(port, proc, timeout=300)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert f"created random-weight model 'tiny' at {tmp_path}" in out, out
    logged = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +\[(serve|prefill0|decode)\] [\w.]+: ")
    printed = [ln for ln in lines if not logged.match(ln)]
    assert all(ln.startswith("trnd: ") for ln in printed), printed  # the banner lines, nothing else
    assert not [ln for ln in lines if " ERROR " in ln or "Traceback" in ln], out
    roles = {logged.match(ln)[2] for ln in lines if logged.match(ln)}
    assert roles == {"serve", "prefill0", "decode"}, roles
    bodies = [ln[9:] for ln in lines]  # without the time
    twice = {b for b in bodies if bodies.count(b) > 1}
    assert not twice, twice
