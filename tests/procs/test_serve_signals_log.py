"""`trnd serve` in a terminal, as a user runs it: Ctrl-C (SIGINT to the whole foreground process group, as a
terminal sends it) during start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import free_port

pytestmark = pytest.mark.slow


def serve(model, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """`trnd serve` as the leader of its own process group, like a shell's foreground job."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--kv-memory-gb", "0.1", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    return proc, port


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def test_ctrl_c_during_start_up_exits_130_without_a_traceback(tiny_qwen3):
    for delay in (0.5, 3.0):  # while importing, and while the roles load
        proc, _ = serve(tiny_qwen3)
        time.sleep(delay)
        ctrl_c(proc)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, (delay, proc.returncode, out)
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
