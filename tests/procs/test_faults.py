"""Fault injection on a disaggregated deployment (real processes on loopback): replayed and forged
handshakes, an identity claimed twice, pre-auth floods, a prefill stopped (SIGSTOP) or a decode
killed (SIGKILL) mid-prefill and mid-transfer, a handoff that stalls. After each, the same prompts
give the same greedy outputs as before, every page comes back, and nothing crashed."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import httpx
import pytest

from trnd.transfer import protocol as P

from tests.launch import admin_state, background, children, free_port, start_role, stop, wait_for, wait_ready
from tests.procs.test_disagg import Deployment, prompts

SECRET = b"test-secret-0123456789"
GREEDY = prompts([7, 300, 1500], seed=11)


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "control_secret"
    path.write_bytes(SECRET)
    return path


def greedy(dep, port=None) -> list[str]:
    port = port or dep.port
    out = []
    for p in GREEDY:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "m", "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _hello_frame(cp: int, agent_name: str) -> tuple[bytes, object]:
    """Handshake as a decode would (valid MAC under this connection's challenge); returns the Hello's
    raw frame (as an on-path observer records it) and the prefill's reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", cp)
    chan = P.Channel(reader, writer, SECRET, name="test")
    sent = []
    orig = writer.write
    writer.write = lambda data: (sent.append(data), orig(data))[1]
    manifest = P.Manifest(role="decode", model_name="m", model_fingerprint="x", dtype="float32", num_layers=1,
                          num_kv_heads=1, head_dim=1, page_size=16, point="8k", max_context=1, max_batch=1, tp=1,
                          rank_heads=[(0, 1)], page_bytes=1)
    await chan.answer(lambda n: P.Hello(manifest, agent_name, b"not-nixl-metadata", [], n))
    reply = await asyncio.wait_for(chan.recv(strict=True), 10)
    chan.close()
    return sent[-1], reply


async def _replay(cp: int, frame: bytes) -> bytes:
    """Send a recorded Hello on a fresh connection: what comes back before the prefill hangs up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", cp)
    got = b""
    writer.write(frame)
    await writer.drain()
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            got += chunk
    except (ConnectionError, asyncio.TimeoutError):
        pass
    writer.close()
    return got


@pytest.fixture(scope="module")
def dep(tiny_qwen3, secret):
    d = Deployment(tiny_qwen3, secret)
    d.expected = greedy(d)
    yield d
    d.close()


def test_recorded_hello_proves_nothing_on_another_connection(dep):
    _, cp, ap = dep.prefills[0]
    frame, reply = asyncio.run(_hello_frame(cp, "decode-observer"))
    assert isinstance(reply, P.Refused)  # it authenticated on its own connection (and was refused: bad manifest)
    before = admin_state(ap)["transfers"]["unauthenticated"]
    got = asyncio.run(_replay(cp, frame))
    # The replayed frame's MAC covers another connection's challenge: no Welcome, no Refused, dropped.
    assert b"Welcome" not in got and b"Refused" not in got
    assert wait_for(lambda: admin_state(ap)["transfers"]["unauthenticated"] > before)
    assert len(admin_state(ap)["peers"]) == 1
    assert greedy(dep) == dep.expected


def test_a_peer_identity_cannot_be_claimed_twice(dep):
    proc, cp, ap = dep.prefills[0]
    real = admin_state(ap)["peers"][0]["agent"]
    _, reply = asyncio.run(_hello_frame(cp, real))
    assert isinstance(reply, P.Refused) and "already connected" in reply.reason
    assert [p["agent"] for p in admin_state(ap)["peers"]] == [real]
    assert greedy(dep) == dep.expected  # the real decode's agent is still known to prefill
    assert proc.poll() is None


def test_pre_auth_frames_are_bounded(dep):
    proc, cp, ap = dep.prefills[0]
    before = rss_mb(proc.pid)
    socks = []
    for _ in range(4):
        s = socket.create_connection(("127.0.0.1", cp))
        s.sendall((60 * 2**20).to_bytes(4, "big"))
        socks.append(s)
    closed = 0
    for s in socks:
        s.settimeout(5)  # well inside the 10 s handshake timeout: only a hang-up at the announcement counts
        try:
            s.sendall(b"\0" * 2**20)
            while s.recv(65536):
                pass
            closed += 1
        except socket.timeout:
            pass
        except OSError:  # reset: hung up on us
            closed += 1
        s.close()
    assert closed == 4
    assert rss_mb(proc.pid) - before < 50
    assert greedy(dep) == dep.expected


def test_sigstop_prefill_mid_prefill_then_sigcont(dep):
    """Decode loses the stopped prefill (no frame for peer_timeout_s: a hung peer is a lost one) and, with no
    peer left, prefills the request itself (local_fallback), and every new request too, with the same greedy
    outputs (before: new requests were held ready_hold_s, 30 s, then 503 not_ready, while a dead prefill was
    not waited for); the resumed prefill posts no write into pages decode reused, does not crash,
    re-handshakes; outputs are unchanged."""
    proc, cp, ap = dep.prefills[0]
    long = prompts([6000], seed=12)[0]
    t, result = background(lambda: dep.complete(long, max_tokens=4))
    assert wait_for(lambda: admin_state(ap)["running"], timeout=20, interval=0.01)
    proc.send_signal(signal.SIGSTOP)
    try:
        t.join(120)
        assert result["status"] == 200, result
        assert greedy(dep) == dep.expected  # while the prefill is still stopped
        state = admin_state(dep.port)
        assert not state["peers"][0]["healthy"] and state["transfers"]["local_fallbacks"] >= len(GREEDY)
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_ready(dep.port, dep.decode, timeout=30)
    assert greedy(dep) == dep.expected
    assert proc.poll() is None
    assert wait_for(dep.baseline_ok, timeout=30)
    assert admin_state(ap)["peers"][0]["healthy"]


def test_a_stalled_handoff_ends_with_504_and_its_pages_come_back(tiny_qwen3, secret, tmp_path, monkeypatch):
    cfg = tmp_path / "decode.toml"
    cfg.write_text("handoff_timeout_s = 2.0\n")
    monkeypatch.setenv("TRND_DEBUG_STALL_S", "1.5")  # prefill's every step sleeps (its heartbeat still answers)
    d = Deployment(tiny_qwen3, secret, decode_extra=("--config", str(cfg)))
    monkeypatch.delenv("TRND_DEBUG_STALL_S")
    try:
        t0 = time.monotonic()
        r = d.complete(prompts([3000], seed=13)[0], max_tokens=4)
        assert r["status"] == 504, r
        assert "did not deliver the KV within 2 s" in r["error"]["message"]
        assert time.monotonic() - t0 < 30
        assert wait_for(d.baseline_ok, timeout=30)  # fenced until prefill's Aborted, then freed
        assert d.prefills[0][0].poll() is None and d.decode.poll() is None
    finally:
        out = d.close()
    assert "engine loop crashed" not in out


@pytest.mark.slow
def test_sigkill_one_of_two_decodes_mid_transfer(tiny_qwen3, secret):
    """Prefill serving two decodes: one is killed while its long prompt is being written; the other's
    requests all succeed, with the same outputs, and prefill's engine loop survives."""
    d = Deployment(tiny_qwen3, secret)
    _, cp, ap = d.prefills[0]
    port2 = free_port()
    dec2 = start_role("decode", tiny_qwen3, secret, "--kv-memory-gb", "0.25", "--served-model-name", "m",
                      "--prefill", f"127.0.0.1:{cp}", port=port2)
    try:
        wait_ready(port2, dec2)
        expected = greedy(d)
        for round in range(3):
            long = prompts([6000], seed=14 + round)[0]  # a new prompt each round: no prefix cache hit
            t, r1 = background(lambda: httpx.post(f"http://127.0.0.1:{port2}/v1/completions", timeout=60,
                                                 json={"prompt": long, "max_tokens": 4}).status_code and {})
            t2, r2 = background(lambda: d.complete(long, max_tokens=4))
            assert wait_for(lambda: len(admin_state(ap)["running"]) >= 1, timeout=20, interval=0.01)
            if dec2.poll() is None:
                dec2.send_signal(signal.SIGKILL)
                dec2.wait()
            t.join(60)
            t2.join(60)
            assert r1 == {} or isinstance(r1["error"], httpx.TransportError), r1  # answered before the kill, or cut
            assert r2["status"] == 200, r2
            assert greedy(d) == expected
            dec2 = start_role("decode", tiny_qwen3, secret, "--kv-memory-gb", "0.25", "--served-model-name", "m",
                              "--prefill", f"127.0.0.1:{cp}", port=port2)
            wait_ready(port2, dec2)
        assert d.prefills[0][0].poll() is None
        assert wait_for(d.baseline_ok, timeout=30)
    finally:
        stop(dec2)
        out = d.close()
    assert "engine loop crashed" not in out and "KeyError" not in out


def _listeners(pids: set[int]) -> list[str]:
    import subprocess

    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[3] for line in out if any(f"pid={p}," in line for p in pids)]


@pytest.mark.slow
def test_local_deployment_auth_bind_reload_and_drain(tiny_qwen3, tmp_path):
    """`trnd serve` (prefill + decode): the prefill's admin port takes the deployment's key; every
    listener of every process (NIXL/UCX's included) is on 127.0.0.1; SIGHUP applies a new api_key
    from the config file; SIGTERM completes every accepted request (drain_timeout_s beyond prefill's
    30 s default), prefill serving until decode has drained."""
    import re
    import subprocess
    import sys

    port = free_port()
    cfg = tmp_path / "serve.toml"
    cfg.write_text('api_key = "old-key"\ndrain_timeout_s = 240\n')
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_qwen3), "--port", str(port),
                             "--config", str(cfg), "--threads", "1", "--kv-memory-gb", "0.25"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        while "local deployment" not in line:
            line = proc.stdout.readline()
        admin = int(re.search(r"prefill0 pid \d+ \(http://127.0.0.1:(\d+)\)", line).group(1))
        wait_ready(port, proc, timeout=180)
        old = {"Authorization": "Bearer old-key"}
        assert httpx.get(f"http://127.0.0.1:{admin}/admin/state", timeout=10).status_code == 401
        assert httpx.post(f"http://127.0.0.1:{admin}/admin/evict", timeout=10).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{admin}/admin/state", headers=old, timeout=10).status_code == 200
        addrs = _listeners({proc.pid} | children(proc.pid))
        assert len(addrs) >= 4 and all(a.startswith("127.0.0.1:") for a in addrs), addrs

        cfg.write_text('api_key = "new-key"\ndrain_timeout_s = 240\n')
        proc.send_signal(signal.SIGHUP)
        new = {"Authorization": "Bearer new-key"}
        assert wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=new).status_code == 200,
                        timeout=20)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=old).status_code == 401
        assert wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/admin/state", headers=new).status_code == 200,
                        timeout=20)

        results = []

        def one(i):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=new, timeout=300,
                           json={"prompt": prompts([1200], seed=100 + i)[0], "max_tokens": 24, "ignore_eos": True})
            results.append(r.status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        assert wait_for(lambda: admin_state_key(port, new)["running"], timeout=30, interval=0.01)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(300)
        assert proc.wait(300) == 0
        accepted = [s for s in results if s != 503]
        assert accepted and all(s == 200 for s in accepted), results
    finally:
        stop(proc)


def admin_state_key(port, headers) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/admin/state", headers=headers, timeout=10).json()
