"""Both CPU classes on any host: every fast path is chosen from what the CPU supports, with a fallback.

`TRND_CPU_ISA=avx2` makes a process behave as an AVX2 + FMA CPU (no AVX-512, no native bf16), torch's
oneDNN and ATen kernels included (trnd/tuning.py), so the fallbacks an AMD Zen 3 host takes are run
here too, in real subprocesses; the fast path is tested where this host has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from trnd_kernels import cpuinfo
from trnd.backends.cpu import CPUBackend
from tests.launch import free_port, stop

AVX2 = {**os.environ, "TRND_CPU_ISA": "avx2"}


@pytest.fixture
def capped(monkeypatch):
    """cpu_info() as an AVX2-only CPU would report it, in this process."""
    def cap(level: str):
        monkeypatch.setenv(cpuinfo.ISA_ENV, level)
        cpuinfo.cpu_info.cache_clear()
        cpuinfo.onednn_bf16_prepack.cache_clear()
    yield cap
    monkeypatch.delenv(cpuinfo.ISA_ENV, raising=False)
    cpuinfo.cpu_info.cache_clear()
    cpuinfo.onednn_bf16_prepack.cache_clear()


def test_avx2_cap_drops_avx512_and_native_bf16(capped):
    capped("avx2")
    info = cpuinfo.cpu_info()
    assert info.isa in ("avx2", "default")
    assert not any(f.startswith(("avx512", "amx")) for f in info.flags)
    assert not info.native_bf16 and not cpuinfo.onednn_bf16_prepack()
    assert "isa" in info.summary() and info.model in info.summary()


def test_cpu_line_tells_generations_apart():
    """Zen 3, 4 and 5 VMs all call themselves "AMD EPYC": the cpu line carries family and model."""
    fields = dict(line.split(":", 1) for line in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines()
                  if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "cpu family" not in fields:
        pytest.skip("no x86 family/model in /proc/cpuinfo on this machine")
    want = f"{fields['model name']} (family {fields['cpu family']} model {fields['model']})"
    assert cpuinfo.cpu_info().model == want and cpuinfo.cpu_info().summary().startswith(want + "; flags: ")


def test_bad_cap_names_the_variable(capped):
    capped("avx1024")
    with pytest.raises(ValueError, match="TRND_CPU_ISA='avx1024'"):
        cpuinfo.cpu_info()


def test_auto_dtype_follows_the_cpu_class(capped):
    capped("avx2")
    assert CPUBackend().pick_dtype("auto")[0] == "float32"
    assert CPUBackend().pick_dtype(None)[0] == "float32"
    assert CPUBackend().pick_dtype("bfloat16") == ("bfloat16", "requested")  # an explicit dtype is honoured
    capped("")  # the CPU as it is
    want = None if cpuinfo.cpu_info().native_bf16 else "float32"
    assert CPUBackend().pick_dtype("auto")[0] == want


def _run(code: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_emulated_avx2_cpu_refuses_onednn_bf16_as_zen3_does():
    """What crashed `make serve` on Zen 3: the raw reorder fails under the cap, so the tests below run the
    real fallback, not a pretend one."""
    r = _run("import json, trnd, torch\n"
             "try:\n"
             "    torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1); e = ''\n"
             "except RuntimeError as x:\n"
             "    e = str(x)\n"
             "print(json.dumps({'error': e, 'cap': torch.backends.cpu.get_cpu_capability()}))", AVX2)
    assert r["cap"] == "AVX2"
    assert "avx512" in r["error"] or "avx_ne_convert" in r["error"]


GENERATE = """
import json, sys
from trnd.llm import LLM
from trnd.engine.request import SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2])
out = llm.generate([list(range(5, 45))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
m = llm.engine.model
print(json.dumps({"tokens": out[0].token_ids, "dtype": str(llm.engine.model_config.dtype),
                  "packed": m.lm_head.packed is not None, "paths": llm.engine.cpu_paths}))
"""


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_bf16_checkpoint_serves_on_an_avx2_cpu(tiny_bf16, dtype):
    r = _run(GENERATE.replace("sys.argv[1]", repr(str(tiny_bf16))).replace("sys.argv[2]", repr(dtype)), AVX2)
    assert len(r["tokens"]) == 8
    # bf16: no oneDNN bf16 reorder on this CPU class, plain F.linear; fp32 (auto): the AVX2 build's fp32 linear
    assert r["packed"] == (dtype == "auto")
    if dtype == "auto":
        assert r["paths"]["linears"] == "compiled torch.ops.trnd_avx2 fp32 (packed at load, bf16-valued weights at 2 bytes)"
    assert r["dtype"] == ("torch.float32" if dtype == "auto" else "torch.bfloat16")
    assert r["paths"]["isa"] == "avx2" and "avx512f" not in r["paths"]["flags"]


def test_bf16_fast_path_where_the_host_has_it(tiny_bf16):
    if not cpuinfo.onednn_bf16_prepack():
        pytest.skip(f"this CPU has no oneDNN bf16 reorder ({cpuinfo.cpu_info().summary()})")
    r = _run(GENERATE.replace("sys.argv[1]", repr(str(tiny_bf16))).replace("sys.argv[2]", "'auto'"),
             {k: v for k, v in os.environ.items() if k != cpuinfo.ISA_ENV})
    assert r["packed"] and r["dtype"] == "torch.bfloat16" and len(r["tokens"]) == 8


def test_backend_this_host_cannot_run_is_one_line_and_exit_69(tiny_qwen3):
    for role in ("serve", "decode"):
        out = subprocess.run([sys.executable, "-m", "trnd", role, "--model", str(tiny_qwen3), "--backend", "neuron"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 69, out.stderr
        assert out.stderr.count("\n") == 1 and "neuron" in out.stderr and "Traceback" not in out.stderr


def test_check_cpu_prints_the_cpu_and_the_paths():
    out = subprocess.run([sys.executable, "-m", "trnd", "check", "cpu"], env=AVX2, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "isa level:    avx2" in out.stdout and "float32" in out.stdout and "F.linear" in out.stdout


@pytest.mark.slow
def test_first_answer_of_v1_models_means_served(tiny_bf16, tmp_path):
    """A client that starts sending the moment /v1/models first answers (as vllm bench serve and most
    harnesses do) is served: no 503 while the prefill peer is still handshaking. Run on the AVX2 class,
    where the bf16 default model crashed the roles before."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--model", str(tiny_bf16), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=AVX2)
    try:
        deadline, first = time.monotonic() + 240, None
        while time.monotonic() < deadline and first is None:
            assert proc.poll() is None, stop(proc)
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=60)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            assert r.status_code == 200, r.text  # held until served, never 503 during start-up
            first = r.json()["data"][0]["id"]
        assert first is not None, "no answer from /v1/models"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model=first, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens >= 1
    finally:
        stop(proc, timeout=30)


@pytest.mark.slow
def test_decode_without_a_prefill_peer_holds_then_503(tiny_qwen3, tmp_path):
    """No prefill peer: /ready is 503 and an OpenAI request is held ready_hold_s, then 503 + Retry-After
    naming what it waits for (never a request lost in a queue)."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    port, dead = free_port(), free_port()
    cfg = tmp_path / "decode.toml"
    cfg.write_text("ready_hold_s = 3.0\n")
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "decode", "--config", str(cfg), "--model", str(tiny_qwen3),
                             "--secret-file", str(secret), "--port", str(port), "--prefill", f"127.0.0.1:{dead}",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, stop(proc)
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert r.status_code == 503
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        held = time.monotonic() - t0
        assert r.status_code == 503 and r.headers.get("retry-after")
        err = r.json()["error"]
        assert err["code"] == "not_ready" and "no prefill peer" in err["message"]
        assert held >= 2.5  # it waited ready_hold_s for a peer instead of failing at once
    finally:
        stop(proc, timeout=30)


def _role(role: str, model, secret, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trnd", role, "--model", str(model), "--secret-file", str(secret),
                             "--threads", "1", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


@pytest.mark.slow
def test_mixed_cpu_classes_agree_on_a_set_dtype_or_are_refused_naming_it(tiny_bf16, tmp_path):
    """A prefill on the AVX2 class and a decode on this host's class: with one dtype set on both they
    handshake and serve; with different dtypes the handshake names `dtype` and both values."""
    from tests.launch import admin_state, wait_for, wait_ready

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    native = {k: v for k, v in os.environ.items() if k != cpuinfo.ISA_ENV}
    for pre_dtype, dec_dtype in (("float32", "bfloat16"), ("float32", "float32")):
        cp, ap, port = free_port(), free_port(), free_port()
        pre = _role("prefill", tiny_bf16, secret, AVX2, "--dtype", pre_dtype, "--control-port", str(cp),
                    "--admin-port", str(ap))
        dec = _role("decode", tiny_bf16, secret, native, "--dtype", dec_dtype, "--port", str(port), "--prefill",
                    f"127.0.0.1:{cp}", "--served-model-name", "m")
        try:
            wait_ready(ap, pre)
            if pre_dtype != dec_dtype:
                wait_ready(port, dec, path="/health")
                assert wait_for(lambda: admin_state(port)["peers"][0]["refused"], timeout=20)
                refused = admin_state(port)["peers"][0]["refused"]
                assert refused.startswith("dtype:") and "'float32'" in refused and "'bfloat16'" in refused
            else:
                wait_ready(port, dec)
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
                assert client.completions.create(model="m", prompt="Hello", max_tokens=3).usage.completion_tokens >= 1
        finally:
            stop(dec, timeout=30), stop(pre, timeout=30)
