"""A process with a NIXL agent exits cleanly where rdma-core is installed (every EFA host): before, the
wheel's UCX loaded its EFA transport, which maps the host's libibverbs and libnl-route-3 beside the wheel's
own copies, and every such process died with SIGSEGV in libnl-route's destructors at exit (139).
CI installs rdma-core (.ci/run) so this runs in that environment; without it the test still holds."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

AGENT = """
import os, sys, torch
from trnd.transfer.nixl import KVAgent
a = KVAgent("exit-test", [torch.zeros(4096)])
maps = open(f"/proc/{os.getpid()}/maps").read()
print("MODULES", os.environ.get("UCX_MODULES"))
print("EFA", "libuct_ib_efa" in maps)
"""


def run_agent(**env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_process_with_an_agent_exits_0_with_or_without_rdma_core():
    rdma = ctypes.util.find_library("efa") is not None  # ibverbs-providers: what made the EFA module load
    r = run_agent()
    assert r.returncode == 0, f"exit {r.returncode} (rdma-core installed: {rdma})\n{r.stderr[-3000:]}"
    assert "MODULES ^efa" in r.stdout and "EFA False" in r.stdout, r.stdout


def test_an_operators_ucx_modules_wins():
    r = run_agent(UCX_MODULES="^efa,cma")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODULES ^efa,cma" in r.stdout
