"""`trnd bench l3` at tiny sizes on `trnd store`: the bench's bytes test is the store's first client, and a
store's first client fixes its slot size. The bench once wrote the checkpoint's bf16 pages there while the
server computed in float32 (`auto` on a CPU without native bf16), so the store refused the server's client
and every "L3 hit" the bench timed was a recompute (issue 52). A bf16 checkpoint served in float32 is that
case on any host."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from trnd.bench.l3 import server_pages
from trnd.engine.runner import kv_page_bytes
from trnd.model.config import ModelConfig


def test_the_bench_pages_are_the_servers_pages(tiny_bf16):
    pool, lay = server_pages(str(tiny_bf16), "float32", 3)
    mc = ModelConfig.from_dir(tiny_bf16, "float32")
    assert pool.dtype == mc.dtype and str(mc.dtype) == "torch.float32"  # not the checkpoint's bf16
    assert lay.page_bytes(0) == kv_page_bytes(mc, mc.pool.heads, lay.page_size) == pool[0].numel() * 4


@pytest.mark.slow
def test_bench_l3_on_trnd_store_loads_the_servers_pages_back(tiny_bf16):
    out = subprocess.run([sys.executable, "-m", "trnd", "bench", "l3", "--model", str(tiny_bf16), "--dtype", "float32",
                          "--backends", "trnd", "--pages", "8", "--batch", "4", "--prompt", "64", "--repeats", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.splitlines()[1].startswith("cpu: ")
    res = ast.literal_eval(next(ln for ln in out.stdout.splitlines() if ln.startswith("  trnd: "))[len("  trnd: "):])
    assert res["read"] == res["written"] == 8 and res["identical"]
    assert res["pages_written"] == 16  # 4 full pages (64 prompt tokens, the first answer token) an answer
    # each rerun computes its last prompt token and loads the rest: 3 pages, every repeat (not only the first)
    assert res["pages_loaded"] == res["pages_expected"] == 6
