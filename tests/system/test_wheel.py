"""What an operator installs (docs/DEPLOY.md, Install): the wheel `pip wheel .` builds from this checkout.

It is a platform wheel holding both ISA builds of the compiled CPU kernels and no top-level name another
distribution could own (`kernels` is Hugging Face's); installed into a fresh venv outside the checkout, as
DEPLOY.md says (torch==2.13.0 first), it loads its kernels (`trnd check cpu`), serves the openai client with
`trnd serve`'s default pair, and refuses in one line to start beside another torch. A build machine without
a C++ compiler fails the build in one line instead of making a wheel without kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import openai
import pytest

from trnd.bench.serve_compare import describe_trnd
from trnd_kernels.cpu import build as kernel_build
from trnd_kernels.cpuinfo import cpu_info
from tests.launch import free_port, stop, wait_ready
from tests.wheel import build_wheel, checkout_copy

pytestmark = pytest.mark.slow
EXPECTED_TOP = {"trnd", "trnd_kernels"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_both_kernel_builds_and_only_our_names(wheel):
    assert re.fullmatch(r"trnd-[\w.]+-py3-none-linux_x86_64\.whl", wheel.name), wheel.name  # a platform wheel
    names = zipfile.ZipFile(wheel).namelist()
    for variant in kernel_build.VARIANTS:
        for f in (f"{variant}.so", "torch_version", "source_digest"):
            assert f"trnd_kernels/cpu/build/{variant}/{f}" in names, sorted(n for n in names if "build" in n)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == EXPECTED_TOP, top
    info = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert set(zipfile.ZipFile(wheel).read(info).decode().split()) == EXPECTED_TOP
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: torch==2.13.0" in meta  # the torch its kernels were built against, pinned
    assert not any(n.endswith((".o", ".ninja", ".cpp")) for n in names)  # objects and sources stay out


def _run(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """DEPLOY.md's Install block with the wheel, into a venv outside the checkout."""
    venv = tmp_path_factory.mktemp("opt") / "trnd"
    base = getattr(sys, "_base_executable", sys.executable)
    for args in ([base, "-m", "venv", str(venv)],
                 [str(venv / "bin/pip"), "install", "-q", "torch==2.13.0"],
                 [str(venv / "bin/pip"), "install", "-q", str(wheel)]):
        r = _run(args, timeout=900)
        assert r.returncode == 0, f"{args}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    return venv


def test_installed_outside_the_checkout_it_loads_its_kernels_and_serves(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRND_", "PYTHON", "VIRTUAL_ENV"))}
    env["TRND_CACHE_DIR"] = str(tmp_path / "cache")
    where = _run([str(installed / "bin/python"), "-c", "import trnd, trnd_kernels; print(trnd.__file__); "
                  "print(trnd_kernels.__file__); import importlib.util; print(importlib.util.find_spec('kernels'))"],
                 cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    lines = where.stdout.split()
    assert all(Path(p).is_relative_to(installed) for p in lines[:2]), lines  # the wheel's, not the checkout's
    assert lines[2] == "None"  # nothing of ours answers `import kernels`
    measured = describe_trnd(str(installed / "bin/python"))  # what serve-compare's table says it measured
    assert measured.startswith(f"the installed package 0.1.0 ({installed}") and "cpu kernels: trnd_avx" in measured, \
        measured
    check = _run([str(installed / "bin/trnd"), "check", "cpu"], cwd=tmp_path, env=env)
    if cpu_info().isa == "default":
        pytest.skip(f"no AVX2 + FMA here ({cpu_info().summary()}): the wheel's kernels cannot run")
    assert check.returncode == 0, check.stdout + check.stderr
    assert re.search(r"^kernels: +compiled trnd_avx(2|512) loaded$", check.stdout, re.M), check.stdout
    model = tmp_path / "tiny"
    assert _run([str(installed / "bin/trnd"), "model", "init", str(model), "--preset", "tiny"], cwd=tmp_path,
                env=env).returncode == 0
    port = free_port()
    proc = subprocess.Popen([str(installed / "bin/trnd"), "serve", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--kv-memory-gb", "0.1"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(port, proc, timeout=240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model=client.models.list().data[0].id, prompt="hello there",
                                          max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1
    finally:
        out = stop(proc, timeout=60)
    assert "cpu kernels: not used" not in out, out[-4000:]
    loaded = re.findall(r"cpu kernels: (trnd_avx2|trnd_avx512)", out)
    assert len(loaded) >= 2, out[-4000:]  # the prefill and the decode server each loaded the wheel's build


def test_installed_beside_another_torch_it_refuses_to_start_in_one_line(installed, tmp_path):
    if cpu_info().isa == "default":
        pytest.skip(f"no AVX2 + FMA here ({cpu_info().summary()}): no kernels to load")
    site = next((installed / "lib").glob("python3*/site-packages"))
    stamps = list(site.glob("trnd_kernels/cpu/build/*/torch_version"))
    assert len(stamps) == len(kernel_build.VARIANTS)
    saved = {s: s.read_text() for s in stamps}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRND_", "PYTHON", "VIRTUAL_ENV"))}
    env["TRND_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        for s in stamps:
            s.write_text("2.99.0+cpu")  # as a wheel built against another torch would say
        r = _run([str(installed / "bin/trnd"), "serve", "--aggregated", "--model", "tiny", "--port", str(free_port()),
                  "--threads", "1"], cwd=tmp_path, env=env, timeout=300)
    finally:
        for s, text in saved.items():
            s.write_text(text)
    assert r.returncode == 78, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "trnd: cannot start" in line]
    assert len(errors) == 1 and "built for torch 2.99.0+cpu" in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_a_build_machine_without_a_compiler_fails_the_build_in_one_line(tmp_path):
    src = checkout_copy(tmp_path / "src")
    for so in (src / "kernels/cpu/build").glob("*/*.so"):
        so.unlink()  # nothing current to reuse: the build must compile
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"))
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
              str(src)], env=env, timeout=600)
    assert r.returncode != 0
    assert not list((tmp_path / "dist").glob("*.whl"))  # no wheel without kernels
    said = [line for line in (r.stdout + r.stderr).splitlines() if "no C++ compiler" in line]
    assert said and all("install g++" in line for line in said), r.stdout[-3000:] + r.stderr[-3000:]
