"""Keys fail closed (issue 47): a key file emptied or removed, then SIGHUP, is a refused reload on every port of
a `trnd serve --decode 2` deployment (router, decode servers, prefill admin): one line each, the running key
kept, no traceback. (At start, a missing or empty key file is exit 78: tests/procs/test_startup_errors.py.)"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.launch import free_port, stop, wait_for

pytestmark = pytest.mark.slow


def status(port: int, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"http://127.0.0.1:{port}{path}", headers=headers, timeout=10).status_code


def test_an_emptied_or_removed_key_file_is_a_refused_reload_everywhere(tiny_qwen3, tmp_path):
    key = tmp_path / "api_key"
    key.write_text("the-key\n")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'api_key_file = "{key}"\n')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--port", str(port),
                             "--config", str(cfg), "--decode", "2", "--threads", "1", "--kv-memory-gb", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = proc.stdout.readline()
        while "local deployment" not in banner:
            banner = proc.stdout.readline()
        ports = {m[0]: int(m[1]) for m in re.findall(r"(\w+) pid \d+ \(http://127.0.0.1:(\d+)\)", banner)}
        routes = {ports["prefill0"]: "/admin/state", ports["decode0"]: "/v1/models", ports["decode1"]: "/v1/models",
                  port: "/v1/models"}
        assert wait_for(lambda: all(_ok(p, r, "the-key") for p, r in routes.items()), timeout=240)
        for p, r in routes.items():
            assert status(p, r, None) == 401, (p, r)
        for change in ("empty", "removed"):
            if change == "empty":
                key.write_text("  \n")
            else:
                key.unlink()
            proc.send_signal(signal.SIGHUP)
            time.sleep(4)  # every process re-read its config (each answers as before, which is the point)
            for p, r in routes.items():
                assert status(p, r, None) == 401, (change, p, r)
                assert status(p, r, "the-key") == 200, (change, p, r)
        assert proc.poll() is None
    finally:
        out = stop(proc, timeout=60)
    assert "Traceback" not in out, out[-5000:]
    refused = [ln for ln in out.splitlines() if "api_key_file" in ln and ("reload" in ln or "refused" in ln)]
    assert any("is empty" in ln for ln in refused) and any("No such file" in ln for ln in refused), out[-5000:]


def _ok(port: int, path: str, key: str) -> bool:
    try:
        return status(port, path, key) == 200
    except httpx.HTTPError:
        return False
