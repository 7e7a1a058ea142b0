"""The engine thread's OpenMP team is the only one: the main thread hands its pool back before the
engine thread starts, and page-copy threads stay single-threaded (trnd/backends/omp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import os, threading, time
import torch
import trnd
from trnd.backends.omp import _libgomp, release_threads, single_threaded

if _libgomp() is None:
    print("no-libgomp"); raise SystemExit
tasks = lambda: len(os.listdir("/proc/self/task"))
x = torch.randn(512, 512)
before = tasks()
x @ x  # a parallel region on the main thread: its pool of workers appears
with_pool = tasks()
release_threads()
# the workers leave after a barrier, detached: /proc drops them a moment later (bounded wait)
deadline = time.monotonic() + 10
while tasks() >= with_pool and time.monotonic() < deadline:
    time.sleep(0.01)
released = tasks()

def helper():
    single_threaded()
    x @ x
    out.append(tasks())

out = []
t = threading.Thread(target=helper); t.start(); t.join()
print(before, with_pool, released, out[0] - 1)  # minus the helper thread itself
"""


def test_main_pool_released_and_helpers_single_threaded():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # spinning workers: the default
    env["OMP_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-libgomp":
        import pytest

        pytest.skip("torch here does not use libgomp")
    before, with_pool, released, helper = map(int, out.stdout.split())
    assert with_pool > before  # the main thread's workers
    assert released < with_pool  # handed back
    assert helper <= released  # the helper ran its matmul without workers of its own


def _omp_env(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "TRND_GOMP_DEFAULT")}
    code = ("import os; from trnd import tuning; op = tuning.omp_set_by_operator(); tuning.tune(); "
            "e = tuning.environ_as_started(); print(op, os.environ.get('GOMP_SPINCOUNT'), e.get('GOMP_SPINCOUNT'))")
    r = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_the_spin_default_is_told_apart_from_an_operators_setting():
    """trnd sets GOMP_SPINCOUNT=20000 for itself and marks it: a trnd process started by another (serve's
    roles, bench's servers) must not take the inherited default for an operator's choice, and programs
    that are not trnd (the bench's peer and load generator) get the environment without it."""
    assert _omp_env() == ["False", "20000", "None"]  # nothing set: the default, not passed on to others
    assert _omp_env(GOMP_SPINCOUNT="20000", TRND_GOMP_DEFAULT="20000") == ["False", "20000", "None"]  # inherited
    assert _omp_env(GOMP_SPINCOUNT="20000") == ["True", "20000", "20000"]  # the operator's, though the same value
    assert _omp_env(GOMP_SPINCOUNT="1000", TRND_GOMP_DEFAULT="20000") == ["True", "1000", "1000"]  # a parent's choice
    assert _omp_env(OMP_WAIT_POLICY="PASSIVE") == ["True", "None", "None"]


def test_importing_trnd_leaves_the_process_as_it_is():
    """Only the commands that run an engine tune the process (trnd/tuning.py, from cli.py): `trnd top`, a
    client importing trnd.config or trnd.snapshot, get no OpenMP spin, malloc change or ISA cap."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "TRND_GOMP_DEFAULT",
                                                              "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    code = ("import os, trnd, trnd.config, trnd.snapshot, trnd.top.app; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('ONEDNN_MAX_CPU_ISA'))")
    r = subprocess.run([sys.executable, "-c", code], env={**base, "TRND_CPU_ISA": "avx2"}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "None"]
