"""The handoff over a real link: prefill in its own network namespace, decode in this one, joined by a
shaped veth pair (trnd/bench/link.py); the NIXL backend named in the roles' configs (UCX or LIBFABRIC)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import msgspec
import pytest

from trnd.sampling_params import SamplingParams
from trnd.transfer import protocol as wire

from tests.launch import admin_state, free_port, stop, wait_ready
from tests.procs.test_disagg import aggregated, prompts


def _manifest(**kw) -> wire.Manifest:
    base = dict(role="prefill", model_name="m", model_fingerprint="f", dtype="float32", num_layers=2, num_kv_heads=2,
                head_dim=8, page_size=16, point="8k", max_context=8192, max_batch=8, tp=1, rank_heads=[(0, 2)],
                page_bytes=1024)
    return wire.Manifest(**(base | kw))


def test_a_transfer_backend_mismatch_is_refused_naming_it():
    a, b = _manifest(), _manifest(role="decode", transfer_backend="libfabric")
    assert wire.mismatch(a, b) == "transfer_backend: prefill has 'ucx', decode has 'libfabric'"
    assert wire.mismatch(a, msgspec.structs.replace(b, transfer_backend="ucx")) is None


def test_libfabric_is_refused_in_one_line_where_its_library_is_missing(tiny_qwen3, tmp_path):
    secret = tmp_path / "s"
    secret.write_text("x" * 32)
    r = subprocess.run([sys.executable, "-m", "trnd", "prefill", "--model", str(tiny_qwen3), "--secret-file",
                        str(secret), "--transfer-backend", "libfabric", "--control-port", str(free_port()),
                        "--admin-port", str(free_port())], capture_output=True, text=True, timeout=120,
                       env=os.environ | {"TRND_LIBFABRIC": str(tmp_path / "none")})
    assert r.returncode == 78, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "transfer_backend = libfabric" in lines[0] and "Traceback" not in r.stderr, r.stderr


def _libfabric_missing() -> str | None:
    r = subprocess.run([sys.executable, "-c", "from trnd.transfer.backends import prepare; prepare('libfabric')"],
                       capture_output=True, text=True, timeout=60)
    return (r.stderr.strip().splitlines() or ["?"])[-1] if r.returncode else None


def test_a_link_slower_than_recompute_is_judged_so_and_a_compute_paced_one_is_not():
    from trnd.transfer.linkrate import LinkEstimate

    est = LinkEstimate()
    assert est.slower_than_recompute(1000, 1024) is None  # nothing measured yet: hand it off
    # 8 writes of 1 MiB each landing 0.1 s apart: the link moves ~10 MB/s; the peer computed 4096 tokens in 0.4 s
    est.observe(8 << 20, 8, 10.0, 10.7, 4096, 0.4)
    link_s, compute_s = est.slower_than_recompute(4096, 2048)
    assert link_s > compute_s and abs(compute_s - 0.4) < 1e-9
    # compute-paced: the writes landed a chunk's compute apart, so the link is at least that fast: stays remote
    paced = LinkEstimate()
    paced.observe(8 << 20, 8, 10.0, 10.3, 4096, 0.4)
    assert paced.slower_than_recompute(4096, 2048) is None


@pytest.fixture(scope="module")
def link():
    from trnd.bench.link import Link, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no network namespaces: {why}")
    with Link(rate="1gbit", delay_ms=0.2) as lk:
        yield lk


class Pair:
    """Prefill inside the link's namespace, decode here; every byte between them crosses the veth."""

    def __init__(self, link, model_dir, tmp_path, backend="ucx", decode_toml=""):
        self.secret = tmp_path / "secret"
        self.secret.write_text("test-secret-0123456789")
        cfg = tmp_path / "decode.toml"  # every prompt to the peer: these tests are about the link
        cfg.write_text("local_when_link_slower = false\n" + decode_toml)
        cp, ap = free_port(), free_port()
        env = os.environ | link.env(backend)
        common = ["--model", str(model_dir), "--secret-file", str(self.secret), "--threads", "1",
                  "--kv-memory-gb", "0.25", "--transfer-backend", backend]
        self.prefill = subprocess.Popen(link.wrap([sys.executable, "-m", "trnd", "prefill", *common, "--host",
                                                   link.ns_addr, "--control-port", str(cp), "--admin-port",
                                                   str(ap)]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env)
        self.port = free_port()
        self.decode = subprocess.Popen([sys.executable, "-m", "trnd", "decode", *common, "--port", str(self.port),
                                        "--prefill", f"{link.ns_addr}:{cp}", "--served-model-name", "m",
                                        "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=env)
        try:
            wait_ready(self.port, self.decode, timeout=180)
        except BaseException:
            self.close()
            raise

    def complete(self, prompt, **kw) -> dict:
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions",
                       json={"model": "m", "prompt": prompt, "temperature": 0, "ignore_eos": True, **kw}, timeout=120)
        return r.json() | {"status": r.status_code}

    def trail(self, rid: str) -> list[str]:
        r = httpx.get(f"http://127.0.0.1:{self.port}/admin/requests/{rid}", timeout=10).json()
        return [p["what"] for t in r["traces"] for p in t["phases"]]

    def close(self) -> str:
        return stop(self.decode) + stop(self.prefill)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ucx", "libfabric"])
def test_greedy_over_the_link_equals_aggregated(link, tiny_qwen3, tmp_path, backend):
    if backend == "libfabric" and (why := _libfabric_missing()):
        pytest.skip(why)
    link.shape("1gbit", 0.2)
    ps = prompts([37, 200, 517])
    want = aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    pair = Pair(link, tiny_qwen3, tmp_path, backend)
    ok = False
    try:
        got = [pair.complete(p, max_tokens=8) for p in ps]
        assert [g["choices"][0]["text"] for g in got] == want
        trail = pair.trail(got[2]["id"])
        assert any(w.startswith("KV digest verified") for w in trail), trail
        st = admin_state(pair.port)
        assert st["transfers"]["digest_failures"] == 0 and st["pages"]["in_use"] == 0
        ok = True
    finally:
        out = pair.close()
    assert ok or "Traceback" not in out, out[-4000:]


@pytest.mark.slow
def test_a_lossy_link_moves_the_kv_byte_for_byte(link, tiny_qwen3, tmp_path):
    """0.5% of the packets dropped each way: TCP retransmits, the digest of what landed equals what was
    written (decode checks it before decoding) and the output equals the aggregated server's."""
    link.shape("1gbit", 0.2, 0.5)
    try:
        ps = prompts([1500, 900], seed=3)
        want = aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        pair = Pair(link, tiny_qwen3, tmp_path)
        try:
            got = [pair.complete(p, max_tokens=6) for p in ps]
            assert [g["choices"][0]["text"] for g in got] == want
            for g in got:
                assert any(w.startswith("KV digest verified") for w in pair.trail(g["id"]))
            assert admin_state(pair.port)["transfers"]["digest_failures"] == 0
        finally:
            pair.close()
    finally:
        link.shape("1gbit", 0.2)


@pytest.mark.slow
def test_a_link_cut_mid_handoff_ends_the_request_in_bounds_and_the_same_prompt_gives_the_same_tokens_after(
        link, tiny_qwen3, tmp_path):
    """The link goes down while a prompt's KV crosses it (10 Mbit/s: about a second of writes): the request ends
    within the decode server's handoff deadline (an error, or its tokens after a retry), no page stays held for
    it, and once the link is back the same prompt gives the aggregated server's tokens."""
    import threading
    import time

    from tests.launch import wait_for

    p = prompts([3000], seed=5)[0]
    want = aggregated(tiny_qwen3, [p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    link.shape("10mbit", 0.2)
    pair = None
    try:
        pair = Pair(link, tiny_qwen3, tmp_path, decode_toml="handoff_timeout_s = 10.0\n")
        res: dict = {}

        def ask():
            try:
                res["r"] = pair.complete(p, max_tokens=6)
            except httpx.HTTPError as e:  # the client's own bound (120 s): a stuck request
                res["r"] = {"status": None, "error": repr(e)}
        t0 = time.monotonic()
        th = threading.Thread(target=ask)
        th.start()
        time.sleep(0.6)
        link.set_up(False)
        th.join(60)
        assert not th.is_alive(), "the request outlived the handoff deadline by far"
        r = res["r"]
        assert r["status"] == 200 and r["choices"][0]["text"] == want or (r["status"] or 0) >= 500, r
        assert time.monotonic() - t0 < 45
        link.set_up(True)
        link.shape("1gbit", 0.2)

        def again():
            g = pair.complete(p, max_tokens=6)
            return g if g["status"] == 200 else None
        g = wait_for(again, timeout=90, interval=2.0)
        assert g and g["choices"][0]["text"] == want, g
        assert wait_for(lambda: (s := admin_state(pair.port))["pages"]["in_use"] == 0 and not s["running"], 30)
    finally:
        link.set_up(True)
        link.shape("1gbit", 0.2)
        if pair is not None:
            pair.close()
