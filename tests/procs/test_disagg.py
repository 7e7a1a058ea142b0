"""Disaggregated prefill/decode as real processes on loopback: the KV crosses over NIXL (UCX), output
equals the aggregated engine's, pools return to their baselines, faults and mismatches are handled."""

from __future__ import annotations

import signal
import socket

import httpx
import openai
import pytest
import torch

from trnd.engine.request import SamplingParams
from trnd.llm import LLM

from tests.launch import admin_state, background, children, free_port, start_role, stop, wait_for, wait_ready


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "control_secret"
    path.write_text("test-secret-0123456789")
    return path


class Deployment:
    def __init__(self, model_dir, secret, prefill_tp=1, decode_tp=1, n_prefill=1, point="8k", decode_extra=(),
                 prefill_extra=()):
        self.model_dir, self.secret = model_dir, secret
        self.prefills, self.decode = [], None
        try:
            for _ in range(n_prefill):
                cp, ap = free_port(), free_port()
                proc = start_role("prefill", model_dir, secret, "--tp", str(prefill_tp), "--point", point,
                                  "--kv-memory-gb", "0.25", *prefill_extra, control_port=cp, admin_port=ap)
                self.prefills.append([proc, cp, ap])
            self.port = free_port()
            peers = [a for _, cp, _ in self.prefills for a in ("--prefill", f"127.0.0.1:{cp}")]
            self.decode = start_role("decode", model_dir, secret, "--tp", str(decode_tp), "--point", point,
                                     "--kv-memory-gb", "0.25", "--served-model-name", "m", *peers, *decode_extra,
                                     port=self.port)
            for proc, _, ap in self.prefills:
                wait_ready(ap, proc)
            wait_ready(self.port, self.decode)
            # ready means one prefill peer handshaked; a test of failing over between peers needs them all
            assert wait_for(lambda: sum(p["healthy"] for p in admin_state(self.port)["peers"]) == n_prefill,
                            timeout=60)
        except BaseException:  # a role that never got ready: stop the ones started (the test's finally never runs)
            self.close()
            raise
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0)

    def complete(self, prompt, **kw) -> dict:
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions",
                       json={"model": "m", "prompt": prompt, "temperature": 0, "ignore_eos": True, **kw}, timeout=120)
        return r.json() | {"status": r.status_code}

    def baseline_ok(self) -> bool:
        d = admin_state(self.port)
        ps = [admin_state(ap) for proc, _, ap in self.prefills if proc.poll() is None]
        return (d["pages"]["in_use"] == 0 and not d["transfers"]["in_flight"] and not d["running"]
                and all(p["pages"]["in_use"] == 0 and not p["running"] for p in ps))

    def close(self) -> str:
        out = stop(self.decode) if self.decode is not None else ""
        for proc, _, _ in self.prefills:
            out += stop(proc)
        return out


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]


def aggregated(model_dir, ps, params) -> list[str]:
    llm = LLM(str(model_dir), page_size=16, num_pages=1024)
    return [c.text for c in llm.generate(ps, params)]


@pytest.fixture(scope="module")
def dep(tiny_qwen3, secret):
    d = Deployment(tiny_qwen3, secret)
    yield d
    d.close()


LENGTHS = [7, 300, 1500, 1100]  # 1500 tokens: three 512-token chunks, three pipelined transfers


def test_greedy_equals_aggregated(dep, tiny_qwen3):
    ps = prompts(LENGTHS)
    expected = aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    got = [dep.complete(p, max_tokens=10)["choices"][0]["text"] for p in ps]
    assert got == expected
    st = admin_state(dep.prefills[0][2])["transfers"]
    assert st["xfers"] >= 1 + 1 + 3 + 3 and st["bytes"] > 0  # one NIXL transfer per chunk
    assert wait_for(dep.baseline_ok)


def test_seeded_sampling_equals_aggregated(dep, tiny_qwen3):
    """The first token is sampled on prefill, the rest on decode: the seeded draw must not care."""
    ps = prompts([40, 700], seed=1)
    expected = aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True))
    got = [dep.complete(p, max_tokens=12, temperature=1.0, seed=1234)["choices"][0]["text"] for p in ps]
    assert got == expected


def test_decode_prefix_cache_dedups_the_handoff(dep):
    base = prompts([640], seed=2)[0]
    a = dep.complete(base + [11, 12], max_tokens=4)
    before = admin_state(dep.port)["transfers"]["kv_pages_received"]
    b = dep.complete(base + [13, 14, 15], max_tokens=4)
    after = admin_state(dep.port)["transfers"]["kv_pages_received"]
    assert a["status"] == b["status"] == 200
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 640  # 40 pages of 16 held by decode
    assert after - before == 1  # only the page with the new tokens crossed the wire


def test_openai_client_streams_through_disaggregation(dep):
    stream = dep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello " * 50}],
                                                max_tokens=8, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert wait_for(dep.baseline_ok)


def test_client_disconnect_aborts_on_prefill_quickly(dep):
    long = prompts([6000], seed=3)[0]  # twelve chunks: long enough to disconnect mid-prefill
    with httpx.stream("POST", f"http://127.0.0.1:{dep.port}/v1/completions",
                      json={"model": "m", "prompt": long, "max_tokens": 50, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert wait_for(lambda: admin_state(dep.prefills[0][2])["running"], timeout=10, interval=0.01)
    assert wait_for(lambda: not admin_state(dep.prefills[0][2])["running"], timeout=1.0, interval=0.02)
    assert wait_for(dep.baseline_ok)


def test_forged_and_malformed_control_messages_are_dropped(dep):
    _, cp, ap = dep.prefills[0]
    with socket.create_connection(("127.0.0.1", cp)) as s:
        s.sendall((10).to_bytes(4, "big") + b"not msgpk!")  # malformed frame
        s.sendall((5).to_bytes(4, "big") + b"\x93\x01\xc4\x00")  # truncated
    assert httpx.get(f"http://127.0.0.1:{ap}/health").status_code == 200
    assert dep.complete([1, 2, 3], max_tokens=2)["status"] == 200  # the real peer is unaffected


def test_short_prompts_are_prefilled_on_decode_long_ones_handed_off(tiny_qwen3, secret):
    """Conditional disaggregation (local_prefill_tokens): a prompt whose uncached part is short is computed
    by the decode server itself, a longer one (and the rest of a long prompt past decode's own cache hit,
    when that is short) by the peer; the output is the aggregated engine's either way and no page leaks."""
    ps = prompts([7, 300, 1100], seed=6)
    expected = aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    d = Deployment(tiny_qwen3, secret, decode_extra=("--local-prefill-tokens", "400"))
    try:
        def counts():
            st = admin_state(d.port)["transfers"]
            return st["local_prefills"], st["handoffs"], admin_state(d.prefills[0][2])["transfers"]["requests"]

        before = counts()  # the warm-up's request
        got = [d.complete(p, max_tokens=8)["choices"][0]["text"] for p in ps]
        assert got == expected
        delta = lambda: tuple(a - b for a, b in zip(counts(), before))
        assert delta() == (2, 1, 1)  # 7 and 300 here, 1100 on the peer
        # 1100 held by decode now (its pages went to decode's prefix cache): 2 more tokens are short
        again = d.complete(ps[2][:1088] + [21, 22], max_tokens=4)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 1088
        assert delta() == (3, 1, 1)
        assert wait_for(d.baseline_ok)
    finally:
        d.close()


@pytest.mark.slow
@pytest.mark.parametrize("ptp,dtp", [(2, 1), (1, 2)])
def test_tp_layouts_hand_off_correctly(tiny_qwen3, secret, ptp, dtp):
    ps = prompts([9, 600], seed=4)
    expected = aggregated(tiny_qwen3, ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    d = Deployment(tiny_qwen3, secret, prefill_tp=ptp, decode_tp=dtp)
    try:
        got = [d.complete(p, max_tokens=8)["choices"][0]["text"] for p in ps]
        assert got == expected
        assert wait_for(d.baseline_ok)
    finally:
        d.close()


def test_mismatched_points_are_refused_with_the_field(tiny_qwen3, secret, tmp_path):
    cp, ap, port = free_port(), free_port(), free_port()
    cfg = tmp_path / "decode.toml"
    cfg.write_text("ready_hold_s = 1.0\n")  # a request is held this long for a peer, then 503 with the reason
    pre = start_role("prefill", tiny_qwen3, secret, "--point", "8k", control_port=cp, admin_port=ap)
    dec = start_role("decode", tiny_qwen3, secret, "--config", str(cfg), "--point", "128k", "--kv-memory-gb", "0.1",
                     "--prefill", f"127.0.0.1:{cp}", "--served-model-name", "m", port=port)
    try:
        wait_ready(ap, pre)
        wait_ready(port, dec, path="/health")
        assert wait_for(lambda: admin_state(port)["peers"][0]["refused"], timeout=10)
        refused = admin_state(port)["peers"][0]["refused"]
        assert "point" in refused and "'8k'" in refused and "'128k'" in refused
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 503 and "point" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "not_ready"
    finally:
        out = stop(dec) + stop(pre)
    assert "refused" in out and "point" in out


def test_mismatched_models_are_refused(tiny_qwen3, tiny_llama, secret):
    cp, ap, port = free_port(), free_port(), free_port()
    pre = start_role("prefill", tiny_llama, secret, control_port=cp, admin_port=ap)
    dec = start_role("decode", tiny_qwen3, secret, "--prefill", f"127.0.0.1:{cp}", port=port)
    try:
        wait_ready(ap, pre)
        wait_ready(port, dec, path="/health")
        assert wait_for(lambda: admin_state(port)["peers"][0]["refused"], timeout=20)
        assert "model_fingerprint" in admin_state(port)["peers"][0]["refused"]
    finally:
        stop(dec), stop(pre)


def test_a_deployment_whose_prefill_never_gets_ready_leaves_no_role_running(tiny_qwen3, secret):
    """A role that fails at start makes the deployment raise before a test's `try`: the roles it had
    started must be stopped there, or the decode role outlives the failed test."""
    before = children()
    with pytest.raises(RuntimeError, match="before it was ready"):
        Deployment(tiny_qwen3, secret, prefill_extra=("--kv-cache-dtype", "fp9"))
    assert children() <= before


def test_wrong_secret_never_handshakes(tiny_qwen3, secret, tmp_path):
    other = tmp_path / "other"
    other.write_text("a-different-secret")
    cp, ap, port = free_port(), free_port(), free_port()
    pre = start_role("prefill", tiny_qwen3, secret, control_port=cp, admin_port=ap)
    dec = start_role("decode", tiny_qwen3, other, "--prefill", f"127.0.0.1:{cp}", port=port)
    try:
        wait_ready(ap, pre)
        wait_ready(port, dec, path="/health")
        assert wait_for(lambda: admin_state(ap)["transfers"]["unauthenticated"] >= 1, timeout=15)
        assert admin_state(port)["peers"][0]["connects"] == 0
        assert httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 503
    finally:
        out = stop(dec)  # the decode side rejects the prefill's Challenge (MACed with the other secret)
        out += stop(pre)
    assert "bad MAC" in out


@pytest.mark.slow
def short_deadline(tmp_path, seconds=15.0) -> tuple[str, str]:
    """A killed peer's target pages are quarantined until its requests' deadline (+ fence_s): a stopped
    prefill posts nothing after it. Short here so the pool's return is seen soon."""
    cfg = tmp_path / "decode-deadline.toml"
    cfg.write_text(f"handoff_timeout_s = {seconds}\n")
    return "--config", str(cfg)


def test_prefill_killed_mid_transfer_retries_on_the_other_peer(tiny_qwen3, secret, tmp_path):
    d = Deployment(tiny_qwen3, secret, n_prefill=2, decode_extra=short_deadline(tmp_path))
    try:
        long = prompts([6000], seed=5)[0]
        expected = aggregated(tiny_qwen3, [long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        t, result = background(lambda: d.complete(long, max_tokens=4))
        # whichever prefill got it: kill it while it is computing/transferring
        victim = wait_for(lambda: next((p for p in d.prefills if admin_state(p[2])["running"]), None), timeout=20,
                          interval=0.01)
        assert victim is not None
        victim[0].send_signal(signal.SIGKILL)
        t.join(60)
        assert result["status"] == 200, result
        assert result["choices"][0]["text"] == expected[0]
        st = admin_state(d.port)["transfers"]
        assert st["retried"] == 1
        d.prefills.remove(victim)
        assert wait_for(d.baseline_ok, timeout=30)  # quarantined pages come back after the deadline + fence_s
    finally:
        d.close()


@pytest.mark.slow
def test_prefill_killed_with_no_other_peer_is_prefilled_here_and_restart_is_rehandshaked(tiny_qwen3, secret,
                                                                                         tmp_path):
    """With no peer left, decode prefills the lost request itself (local_fallback), the same greedy reply as
    the aggregated server; a restarted prefill is handshaked again and used."""
    d = Deployment(tiny_qwen3, secret, decode_extra=short_deadline(tmp_path))
    try:
        proc, cp, ap = d.prefills[0]
        long = prompts([6000], seed=6)[0]
        expected = aggregated(tiny_qwen3, [long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        t, result = background(lambda: d.complete(long, max_tokens=4))
        assert wait_for(lambda: admin_state(ap)["running"], timeout=20, interval=0.01)
        proc.send_signal(signal.SIGKILL)
        t.join(120)
        assert result["status"] == 200 and result["choices"][0]["text"] == expected[0], result
        assert admin_state(d.port)["transfers"]["local_fallbacks"] >= 1
        assert wait_for(d.baseline_ok, timeout=30)
        # restart the prefill on the same port: decode re-handshakes by itself
        new = start_role("prefill", tiny_qwen3, secret, "--kv-memory-gb", "0.25", control_port=cp, admin_port=ap)
        d.prefills[0][0] = new
        wait_ready(ap, new)
        wait_ready(d.port, d.decode, timeout=30)
        assert d.complete([1, 2, 3, 4], max_tokens=3)["status"] == 200
    finally:
        d.close()


@pytest.mark.slow
def test_decode_killed_prefill_frees_its_pages(tiny_qwen3, secret):
    d = Deployment(tiny_qwen3, secret)
    try:
        long = prompts([6000], seed=7)[0]
        background(lambda: d.complete(long, max_tokens=4))  # its decode is killed below: a lost connection
        ap = d.prefills[0][2]
        assert wait_for(lambda: admin_state(ap)["running"], timeout=20, interval=0.01)
        d.decode.send_signal(signal.SIGKILL)
        assert wait_for(lambda: admin_state(ap)["pages"]["in_use"] == 0 and not admin_state(ap)["running"]
                        and not admin_state(ap)["peers"], timeout=10)
    finally:
        d.close()
