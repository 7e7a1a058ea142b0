"""Logs an operator can read: a peer that stays away is a few lines, not one per retry; roles stop
(cleanly, or while loading) without a traceback."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.launch import admin_state, free_port, refused_port, start_role, stop, wait_for, wait_ready
from trnd.log import Failures


class Output:
    """A process's merged stdout/stderr, read as it comes (so a test can count lines at a moment)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def stop(self, timeout: float = 60) -> int:
        stop(self.proc, timeout)
        self._thread.join(10)
        return self.proc.returncode

    def text(self) -> str:
        return "\n".join(self.lines)


def test_failures_are_logged_first_then_at_growing_intervals_then_once_recovered(caplog):
    log = logging.getLogger("test.failures")
    f = Failures(log, "peer x")
    with caplog.at_level(logging.DEBUG, logger="test.failures"):
        for t in range(0, 400):  # one attempt a second for 400 s, the same failure
            f.failed("connection refused", now=float(t))
        f.failed("refused: dtype", now=400.0)  # a new kind of failure: said at once
        assert f.recovered(now=401.0) == " after 401 failed attempts over 401 s"
        assert f.recovered(now=402.0) is None
        f.failed("connection refused", now=500.0)  # after a recovery, a first failure again
    got = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert got[0] == ("ERROR", "peer x: connection refused")
    repeats = [m for lvl, m in got if lvl == "WARNING"]
    # at 10, 40 and 130 s: 10 s, then x3 (the next, at 400 s, is the new failure's)
    assert [int(re.search(r"(\d+) attempts", m)[1]) for m in repeats] == [11, 41, 131], repeats
    assert got[-2] == ("ERROR", "peer x: refused: dtype") and got[-1] == ("ERROR", "peer x: connection refused")
    assert len(got) == 6


@pytest.mark.slow
def test_an_absent_or_refusing_peer_is_a_few_lines_and_roles_stop_without_a_traceback(tiny_qwen3, tiny_bf16,
                                                                                       tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    ctrl, admin, port, bad_port = free_port(), free_port(), free_port(), free_port()
    outs: list[Output] = []
    try:
        decode = Output(start_role("decode", tiny_qwen3, secret, "--prefill", f"127.0.0.1:{ctrl}", port=port))
        outs.append(decode)
        def lines_about():
            return [ln for ln in decode.lines if f"prefill 127.0.0.1:{ctrl}:" in ln]

        assert wait_for(lines_about, timeout=60), decode.text()  # the first failed attempt is logged
        time.sleep(12)  # ~7 more attempts to reach the absent prefill server, and still 1-3 lines about it
        about = lines_about()
        # a peer that never answered, within the start-up grace: info, not an error on every healthy start
        assert 1 <= len(about) <= 3 and "unreachable" in about[0] and "not up yet" in about[0], decode.text()
        assert not [ln for ln in about if "ERROR" in ln], decode.text()
        prefill = Output(start_role("prefill", tiny_qwen3, secret, control_port=ctrl, admin_port=admin))
        outs.append(prefill)
        try:
            wait_ready(port, decode.proc, timeout=120)
        except TimeoutError as e:  # both roles' own lines: wait_ready's capture is empty (Output reads stdout)
            raise AssertionError(f"{e}\n--- decode:\n{decode.text()[-4000:]}\n--- prefill:\n{prefill.text()[-4000:]}")
        back = [ln for ln in decode.lines if f"prefill 127.0.0.1:{ctrl} handshaked" in ln]
        assert len(back) == 1 and re.search(r"after \d+ failed attempts over \d+ s", back[0]), decode.text()
        # A decode server the prefill server must refuse (another model): it retries with backoff.
        bad = Output(start_role("decode", tiny_bf16, secret, "--prefill", f"127.0.0.1:{ctrl}", "--dtype", "bfloat16",
                                port=bad_port))
        outs.append(bad)
        assert wait_for(lambda: admin_state(admin)["transfers"]["refused"] >= 5, timeout=90), prefill.text()
        refusals = [ln for ln in prefill.lines if "decode server 127.0.0.1" in ln and "refused" in ln]
        assert 1 <= len(refusals) <= 2 and "ERROR" in refusals[0] and "model_fingerprint" in refusals[0], prefill.text()
        told = [ln for ln in bad.lines if f"prefill 127.0.0.1:{ctrl}:" in ln]
        assert 1 <= len(told) <= 2 and "refused the handshake" in told[0], bad.text()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        for o in (bad, decode, prefill):  # a clean stop of each: exit 0, no traceback
            assert o.stop() == 0, o.text()
    finally:
        for o in outs:
            o.stop()
    for o in outs:
        assert "Traceback" not in o.text() and "CancelledError" not in o.text(), o.text()


@pytest.mark.slow
@pytest.mark.parametrize("role", ["decode", "prefill", "router", "store"])
def test_stop_while_loading_or_serving_leaves_no_traceback(tiny_qwen3, tmp_path, role):
    """SIGTERM at several moments of the start (importing, loading, warming up, serving), and a second
    one close behind it (a supervisor's forwarded signal, then its death signal)."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    args = {"decode": ["decode", "--model", str(tiny_qwen3), "--secret-file", str(secret), "--prefill",
                       f"127.0.0.1:{refused_port()}"],
            "prefill": ["prefill", "--model", str(tiny_qwen3), "--secret-file", str(secret)],
            "router": ["router", "--target", f"127.0.0.1:{refused_port()}", "--model", str(tiny_qwen3)],
            "store": ["store", "--secret-file", str(secret), "--memory-gb", "0.01"]}[role]
    for delay in (2.0, 5.0):
        ports = (["--control-port", str(free_port()), "--admin-port", str(free_port())] if role in ("prefill", "store")
                 else ["--port", str(free_port())])
        proc = subprocess.Popen([sys.executable, "-m", "trnd", *args, *ports, "--threads", "1"] if role in
                                ("decode", "prefill") else [sys.executable, "-m", "trnd", *args, *ports],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where it hung: faulthandler dumps every thread on SIGABRT
            proc.send_signal(signal.SIGABRT)
            out, _ = proc.communicate(timeout=30)
            pytest.fail(f"{role} still running 60 s after SIGTERM at {delay} s:\n{out[-6000:]}")
        assert proc.returncode in (0, -signal.SIGTERM), out  # -15: the signal came before Python set its handlers
        assert "Traceback" not in out and "Exception ignored" not in out, out


def test_a_megabyte_string_is_cut_in_the_log():
    """Before: a 1 MB session_id or user was logged whole on the request's lines (5 requests, 8.5 MB of log)."""
    import logging

    from trnd.engine.trace import _short
    from trnd.log import MAX_MESSAGE_CHARS, _Formatter

    big = "s" * 2**20
    for journal in (False, True):
        rec = logging.LogRecord("trnd.api", logging.INFO, __file__, 1, "request x: session_id=%s", (big,), None)
        line = _Formatter(journal).format(rec)
        assert len(line) < MAX_MESSAGE_CHARS + 200 and line.endswith(f"(message cut: {len(big) + 22} characters)")
    assert len(_short(big)) < 200 and _short("alice") == "alice" and _short(None) is None


def test_a_peer_not_up_yet_at_start_is_info_until_its_grace_ends(caplog):
    """A deployment's roles come up together: the first failures to reach a peer that never answered are info
    lines while the grace lasts, the first one after it an error; once it answered, failures are errors."""
    log = logging.getLogger("test.grace")
    f = Failures(log, "prefill p", grace_s=120.0)
    t0 = f.grace_until - 120.0
    with caplog.at_level(logging.DEBUG, logger="test.grace"):
        for t in range(0, 30):
            f.failed("unreachable: refused", now=t0 + t)
        f.failed("unreachable: refused", now=t0 + 121.0)
        assert f.recovered(now=t0 + 122.0) is not None
        f.failed("unreachable: refused", now=t0 + 123.0)
    got = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert got[0] == ("INFO", "prefill p: unreachable: refused (not up yet: retrying)")
    assert all(level == "INFO" for level, _ in got[:-2])
    assert got[-2] == ("ERROR", "prefill p: unreachable: refused") and got[-1][0] == "ERROR"
