"""No silent slow path: a process that runs without the compiled CPU kernels on a CPU that could run them
says so (one WARNING at start, trnd:cpu_kernels_loaded 0, /admin/state, `trnd check cpu` exit 1), and a
build stamped for another torch is refused at start in one line. TRND_KERNELS_BUILD points the loader at
another build directory: an empty one is an install without the kernels, a copy with an edited stamp a
wheel installed beside another torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from trnd_kernels.cpu import build, kernels_status
from trnd_kernels.cpuinfo import cpu_info

from tests.launch import free_port, stop, wait_ready

pytestmark = pytest.mark.skipif(cpu_info().isa == "default", reason=f"no AVX2 + FMA here ({cpu_info().summary()}): "
                                "nothing to load, no slow path to report")


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRND_KERNELS_BUILD", "TRND_CPU_KERNELS")}
    env.update(kw)
    return env


def _serve(model, env) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", str(model),
                             "--port", str(port), "--threads", "1", "--kv-memory-gb", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, port


def _gauge(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^trnd:cpu_kernels_loaded\{[^}]*build="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


def test_this_checkout_loads_its_kernels():
    """The suite runs on a checkout after `make venv`: its own build loads (else every figure is the slow path)."""
    k = kernels_status()
    assert k.loaded, k.why
    assert not k.slow_path and k.build in build.VARIANTS


def test_check_cpu_exits_nonzero_without_the_kernels(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "trnd", "check", "cpu"], capture_output=True, text=True, env=_env())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.search(r"^kernels: +compiled trnd_avx(2|512) loaded$", ok.stdout, re.M), ok.stdout
    bad = subprocess.run([sys.executable, "-m", "trnd", "check", "cpu"], capture_output=True, text=True,
                         env=_env(TRND_KERNELS_BUILD=str(tmp_path / "none")))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert re.search(r"^kernels: +NOT LOADED: .*is not built", bad.stdout, re.M), bad.stdout
    off = subprocess.run([sys.executable, "-m", "trnd", "check", "cpu"], capture_output=True, text=True,
                         env=_env(TRND_KERNELS_BUILD=str(tmp_path / "none"), TRND_CPU_KERNELS="0"))
    assert off.returncode == 0 and "not used: TRND_CPU_KERNELS=0" in off.stdout, off.stdout  # the explicit opt-out


@pytest.mark.slow
def test_a_server_without_its_kernels_warns_and_says_so_in_metrics_and_state(tiny_qwen3, tmp_path):
    proc, port = _serve(tiny_qwen3, _env(TRND_KERNELS_BUILD=str(tmp_path / "none")))
    try:
        wait_ready(port, proc)
        assert _gauge(port) == {kernels_status().build: 0.0}
        k = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=10).json()["kernels"]
        assert k["loaded"] is False and k["slow_path"] is True and k["kind"] == "missing", k
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": tiny_qwen3.name, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text  # it still serves, on the torch ops
    finally:
        out = stop(proc)
    warnings = [line for line in out.splitlines() if "WARNING" in line and "cpu kernels: not used" in line]
    assert len(warnings) == 1 and "is not built" in warnings[0], out[-3000:]


@pytest.mark.slow
def test_a_server_with_its_kernels_reports_them(tiny_qwen3):
    proc, port = _serve(tiny_qwen3, _env())
    try:
        wait_ready(port, proc)
        assert _gauge(port) == {kernels_status().build: 1.0}
        k = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=10).json()["kernels"]
        assert k == {"loaded": True, "build": kernels_status().build, "kind": "loaded", "why": "", "slow_path": False}
    finally:
        out = stop(proc)
    assert "cpu kernels: not used" not in out


def test_a_build_for_another_torch_is_refused_at_start_in_one_line(tiny_qwen3, tmp_path):
    name = kernels_status().build
    other = tmp_path / "build"
    shutil.copytree(build.BUILD / name, other / name, ignore=shutil.ignore_patterns("*.o", "*.ninja*"))
    (other / name / "torch_version").write_text("2.12.0+cpu")
    proc, port = _serve(tiny_qwen3, _env(TRND_KERNELS_BUILD=str(other)))
    try:
        proc.wait(120)
    finally:
        out = stop(proc)
    assert proc.returncode == 78, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith(("trnd:", "<3>trnd:"))]
    assert len(errors) == 1 and "built for torch 2.12.0+cpu" in errors[0] and "TRND_CPU_KERNELS=0" in errors[0], out
    assert "Traceback" not in out


def test_the_build_without_a_compiler_fails_in_one_line(tmp_path):
    """`python -m trnd_kernels.cpu.build` (and the package build, which calls the same build_into) with no
    compiler: one line and a failure, not a kernel-less install."""
    r = subprocess.run([sys.executable, "-m", "trnd_kernels.cpu.build"], capture_output=True, text=True,
                       env=_env(TRND_KERNELS_BUILD=str(tmp_path / "empty"), CXX=str(tmp_path / "no-such-c++")))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no C++ compiler" in r.stderr, r.stderr
    assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").rglob("*.so"))
