"""Prefill and decode on two hosts: two network namespaces joined by a veth pair, the KV crossing over
UCX/TCP. Needs root (ip netns); skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from trnd.engine.request import SamplingParams

from tests.procs.test_disagg import aggregated, prompts


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (ip netns)")
    tag = uuid.uuid4().hex[:6]
    a, b = f"trnd-a-{tag}", f"trnd-b-{tag}"
    try:
        sh("ip", "netns", "add", a)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot create network namespaces here: {getattr(e, 'stderr', e)}")
    try:
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        sh("ip", "link", "set", f"va{tag}", "netns", a)
        sh("ip", "link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", "10.77.0.1/24"), (b, f"vb{tag}", "10.77.0.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        sh("ip", "netns", "del", a, check=False)
        sh("ip", "netns", "del", b, check=False)


CLIENT = r"""
import json, sys, httpx
from trnd.procs import wait_ready
port, prompts = int(sys.argv[1]), json.loads(sys.argv[2])
wait_ready(port, [], 90)
texts = []
for p in prompts:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
        "model": "m", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    texts.append(r.json()["choices"][0]["text"])
state = httpx.get(f"http://127.0.0.1:{port}/admin/state").json()
print(json.dumps({"texts": texts, "peer": state["peers"][0], "in_use": state["pages"]["in_use"]}))
"""


@pytest.mark.slow
def test_kv_crosses_a_veth_pair_over_ucx_tcp(two_hosts, tiny_qwen3, tmp_path):
    a, b = two_hosts
    secret = tmp_path / "secret"
    secret.write_text("two-hosts-secret")
    env = dict(os.environ, UCX_TLS="tcp")
    common = ["--model", str(tiny_qwen3), "--secret-file", str(secret), "--threads", "1", "--kv-memory-gb", "0.1"]
    pre = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-m", "trnd", "prefill", *common,
                            "--host", "10.77.0.1", "--control-port", "8100", "--admin-port", "8101"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dec = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-m", "trnd", "decode", *common,
                            "--port", "8000", "--prefill", "10.77.0.1:8100", "--served-model-name", "m"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ps = prompts([5, 700], seed=9)
        cli = sh("ip", "netns", "exec", b, sys.executable, "-c", CLIENT, "8000", json.dumps(ps), check=False)
        assert cli.returncode == 0, cli.stderr
        got = json.loads(cli.stdout.strip().splitlines()[-1])
    finally:
        for p in (dec, pre):
            p.terminate()
        out = "".join(p.communicate(timeout=20)[0] for p in (dec, pre))
    assert got["peer"]["healthy"], out
    assert got["in_use"] == 0
    assert got["texts"] == aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
