"""glibc's malloc backs trnd's large blocks (weights, KV pool) with transparent huge pages: the commands that
load a model re-exec once with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (trnd/tuning.py, trnd/cli.py); an
operator's own tunable or TRND_MALLOC_TUNE=0 is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trnd import tuning

THP = "/sys/kernel/mm/transparent_hugepage/enabled"
GLIBC = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else ""
HAS_TUNABLE = GLIBC.startswith("glibc ") and tuple(int(x) for x in GLIBC.split()[1].split(".")[:2]) >= (2, 35)
THP_ON = os.path.exists(THP) and "[never]" not in open(THP).read()
needs = pytest.mark.skipif(not (HAS_TUNABLE and THP_ON),
                           reason=f"needs glibc >= 2.35 and THP not 'never' (here: {GLIBC or 'no glibc'}, "
                                  f"THP {'on' if THP_ON else 'off or absent'})")


def _env(**kv):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "TRND_MALLOC_TUNE")}
    env.update(kv)
    return env


@needs
def test_the_environment_asks_for_huge_pages(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("TRND_MALLOC_TUNE", raising=False)
    assert tuning.huge_pages_environ()["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # an operator's other tunables stay
    assert tuning.huge_pages_environ()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")  # an operator's own choice wins
    assert tuning.huge_pages_environ() is None
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("TRND_MALLOC_TUNE", "0")
    assert tuning.huge_pages_environ() is None


def _started(args, env) -> subprocess.CompletedProcess:
    """The CLI (trnd.cli.main, as `python -m trnd` runs it) with <args>; the process it ends as prints its
    GLIBC_TUNABLES at exit (an exec'd-away process runs no atexit)."""
    code = ("import atexit, os, sys; atexit.register(lambda: print('TUNABLES', os.environ.get('GLIBC_TUNABLES', '-'),"
            " os.getpid())); sys.argv = ['trnd', *sys.argv[1:]]; from trnd.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


@needs
def test_serve_re_execs_once_with_the_tunable_and_keeps_its_pid():
    out = _started(["serve", "--help"], _env())
    line = [x for x in out.stdout.splitlines() if x.startswith("TUNABLES")]
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
    assert line == [line[0]] and line[0].split()[1] == "glibc.malloc.hugetlb=1"  # printed by one process


def test_lightweight_commands_and_an_opted_out_operator_do_not_re_exec():
    for args, env in ((["points", "--help"], _env()), (["serve", "--help"], _env(TRND_MALLOC_TUNE="0"))):
        out = _started(args, env)
        line = [x for x in out.stdout.splitlines() if x.startswith("TUNABLES")]
        assert line and line[0].split()[1] == "-", (args, out.stdout, out.stderr)


@needs
def test_programs_that_are_not_trnd_get_the_operators_environment(monkeypatch):
    """`trnd bench` starts vLLM and its load generator as their operator would: without trnd's tunable."""
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.delenv("TRND_MALLOC_TUNE", raising=False)
    for k, v in tuning.huge_pages_environ().items():  # this process as the re-exec would have started it
        monkeypatch.setenv(k, v)
    assert tuning.environ_as_started()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    monkeypatch.setenv("TRND_GLIBC_TUNABLES_WAS", "")  # the operator had none
    assert "GLIBC_TUNABLES" not in tuning.environ_as_started()
