"""Mooncake Store as the L3 tier (store/mooncake.py) against a real `mooncake_master` the suite starts: pages
written by a TP=2 client come back byte-identical to a TP=1 client (bf16 and fp8 pages with their scales);
a corrupted page and a page of another model are never served; a master that dies is a miss within the
deadline, logged and counted, never a hang; a served conversation's history comes back from Mooncake on a
cold server with the same greedy output."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from trnd.store.mooncake import MooncakeTier
from trnd.transfer.plan import Layout

from tests.launch import Server, free_port
from tests.procs.test_disagg import prompts
from tests.procs.test_store import NUM_PAGES, PS, canonical, fill, hashes, layout, new_pools

mooncake = pytest.importorskip("mooncake.store", reason="the mooncake extra (pip install 'trnd[mooncake]')")


class Master:
    """mooncake_master (shipped in the wheel) with its HTTP metadata server, and one store node (mooncake_client
    lending 64 MB: the clients under test lend none, so pages outlive them), on free loopback ports."""

    def __init__(self):
        exe = Path(sys.executable).with_name("mooncake_master")
        exe = str(exe) if exe.exists() else shutil.which("mooncake_master")
        self.rpc, self.http = free_port(), free_port()
        self.node = None
        self.proc = subprocess.Popen([exe, f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                                      "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http}",
                                      "--http_metadata_server_host=127.0.0.1",
                                      # its metrics server's default port is fixed (9003): a second master on the
                                      # host (another test run, a benchmark) would take it and this one exit
                                      f"--metrics_port={free_port()}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                httpx.get(f"http://127.0.0.1:{self.http}/metadata?key=probe", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            self.kill()
            raise RuntimeError(f"mooncake_master did not start (exit status {self.proc.poll()})")
        self.node = subprocess.Popen([str(Path(exe).with_name("mooncake_client")), "--global_segment_size=64MB",
                                      "--local_buffer_size=16MB", f"--master_server_address=127.0.0.1:{self.rpc}",
                                      f"--metadata_server=http://127.0.0.1:{self.http}/metadata", "--host=127.0.0.1",
                                      f"--port={free_port()}", "--protocol=tcp"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # it mounts its segment at the master
        if self.proc.poll() is not None or self.node.poll() is not None:
            self.kill()
            raise RuntimeError(f"mooncake exited: master {self.proc.poll()}, store node {self.node.poll()}")

    def config(self, **kw) -> SimpleNamespace:
        return SimpleNamespace(backend="mooncake", master=f"127.0.0.1:{self.rpc}",
                               metadata_server=f"http://127.0.0.1:{self.http}/metadata", protocol="tcp", device="",
                               local_hostname="127.0.0.1", segment_gb=0, buffer_gb=0.02, **kw)

    def remote_json(self) -> str:
        return json.dumps({k: v for k, v in vars(self.config()).items()})

    def kill(self) -> None:
        for p in (self.proc, self.node):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture
def master():
    m = Master()
    yield m
    m.kill()


def tier(master, tp: int, ns: str = "model-a", lay=None, pools=None, deadline: float = 5.0) -> MooncakeTier:
    return MooncakeTier(master.config(), lay or layout(tp), pools if pools is not None else new_pools(tp), ns,
                        dtype="bfloat16", deadline_s=deadline)


def test_tp2_writes_tp1_reads_byte_identical_and_lookups_count_leading_pages(master):
    writer, reader = tier(master, 2), tier(master, 1)
    try:
        hs = hashes(6, "model-a")
        src = list(range(6))
        fill(writer.pools, src, seed=1)
        assert reader.lookup(hs).result(10) == 0
        assert writer.write(hs[:4], src[:4]).result(10) == 4
        assert reader.lookup(hs).result(10) == 4  # the leading pages present
        dst = [10, 11, 12, 13, 14, 15]
        assert reader.read(hs, dst).result(10) == 4
        for s, d in zip(src[:4], dst[:4]):
            assert canonical(reader.pools, d) == canonical(writer.pools, s)
        assert writer.write(hs, src).result(10) == 6  # 4 present, 2 new
        assert writer.state()["stores"][0]["pages_present"] == 4
        st = reader.state()
        assert st["stores"][0]["pages_loaded"] == 4 and st["fenced_pages"] == 0 and st["stores"][0]["healthy"]
    finally:
        writer.close()
        reader.close()


def test_fp8_pages_travel_with_their_scales(master):
    """fp8 pages: each (layer, k|v, head) block is its fp8 tile then its fp32 scale (kernels/fp8.py)."""
    L, H, HD = 2, 4, 8
    block = PS * HD + 4  # fp8 bytes + the scale, as uint8 rows

    def lay(tp):
        return Layout(L, PS, HD, 1, tuple((r * H // tp, (r + 1) * H // tp) for r in range(tp)), scale_bytes=4)

    def pools(tp):
        return [torch.zeros(NUM_PAGES, L, 2, H // tp, block, dtype=torch.uint8) for _ in range(tp)]

    w_pools, r_pools = pools(2), pools(1)
    g = torch.Generator().manual_seed(3)
    for p in w_pools:
        p[:3] = torch.randint(0, 255, p[:3].shape, dtype=torch.uint8, generator=g)
    writer = MooncakeTier(master.config(), lay(2), w_pools, "model-fp8", dtype="fp8_e4m3", deadline_s=5)
    reader = MooncakeTier(master.config(), lay(1), r_pools, "model-fp8", dtype="fp8_e4m3", deadline_s=5)
    try:
        hs = hashes(3, "model-fp8")
        assert writer.write(hs, [0, 1, 2]).result(10) == 3
        assert reader.read(hs, [5, 6, 7]).result(10) == 3
        for s, d in zip([0, 1, 2], [5, 6, 7]):
            assert torch.equal(torch.cat([p[s] for p in w_pools], dim=2), r_pools[0][d])
    finally:
        writer.close()
        reader.close()


def test_a_corrupted_or_foreign_page_is_never_served(master):
    a = tier(master, 1, "model-a")
    b = tier(master, 1, "model-b")  # same geometry, another model (namespace): another key space
    try:
        hs = hashes(3, "model-a")
        fill(a.pools, [0, 1, 2], seed=2)
        assert a.write(hs, [0, 1, 2]).result(10) == 3
        assert b.lookup(hs).result(10) == 0 and b.read(hs, [3, 4, 5]).result(10) == 0
        # flip a byte of page 1's value in Mooncake itself (its key is the tier's own)
        bad = bytearray(a.store.get(a.key(hs[1])))
        bad[7] ^= 0xFF
        assert a.store.remove(a.key(hs[1]), True) == 0 and a.store.put(a.key(hs[1]), bytes(bad)) == 0
        assert a.read(hs, [10, 11, 12]).result(10) == 1  # page 0 only: page 1 fails its checksum
        assert a.state()["stores"][0]["corrupt"] == 1
        deadline = time.monotonic() + 5
        while a.store.is_exist(a.key(hs[1])) == 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.store.is_exist(a.key(hs[1])) != 1  # the bad page was removed
    finally:
        a.close()
        b.close()


def test_a_dead_master_is_a_counted_logged_miss_never_a_hang(master, caplog):
    t = tier(master, 1, deadline=1.0)
    try:
        hs = hashes(2, "model-a")
        fill(t.pools, [0, 1], seed=4)
        assert t.write(hs, [0, 1]).result(10) == 2
        master.kill()
        caplog.set_level(logging.WARNING, logger="trnd.store.mooncake")
        t0 = time.monotonic()
        assert t.lookup(hs).result(10) == 0
        assert t.read(hs, [5, 6]).result(10) == 0
        assert t.write(hashes(2, "model-a", seed=9), [0, 1]).result(10) == 0
        assert time.monotonic() - t0 < 3 * 1.0 + 2  # each within its deadline (plus slack for a busy CI)
        st = t.state()
        assert st["failures"] + st["timeouts"] >= 3 and not st["stores"][0]["healthy"] and st["stores"][0]["error"]
        assert any("mooncake" in r.getMessage() for r in caplog.records)
    finally:
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 10  # bounded even with the master gone


@pytest.mark.slow
def test_a_cold_server_loads_the_history_from_mooncake(tiny_qwen3, tmp_path, master):
    """Two aggregated servers on one master: B (cold) serves A's conversation from Mooncake (cached_tokens
    by source "remote", same greedy text); with the master killed, B still answers (a miss)."""
    prompt = prompts([300], seed=8)[0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    remote = ("--remote-config", master.remote_json())
    a = Server(tiny_qwen3, tmp_path, "--aggregated", *remote)
    try:
        first = httpx.post(f"{a.url}/v1/completions", json=body, timeout=60).json()
        deadline = time.monotonic() + 10
        while httpx.get(f"{a.url}/admin/state", timeout=5).json()["tiers"]["remote"]["pages_written"] < 18 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        a.stop()
    b = Server(tiny_qwen3, tmp_path, "--aggregated", *remote)
    try:
        r = httpx.post(f"{b.url}/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["text"] == first["choices"][0]["text"]
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288
        m = httpx.get(f"{b.url}/metrics", timeout=10).text
        assert 'trnd:prompt_tokens_cached_total{model_name="tiny-qwen3",source="remote"}' in m
        master.kill()
        other = dict(body, prompt=prompts([200], seed=9)[0])
        t0 = time.monotonic()
        assert httpx.post(f"{b.url}/v1/completions", json=other, timeout=60).status_code == 200
        assert time.monotonic() - t0 < 30
        remote_state = httpx.get(f"{b.url}/admin/state", timeout=10).json()["tiers"]["remote"]
        assert remote_state["failures"] + remote_state["timeouts"] >= 1
    finally:
        b.stop()
    assert "mooncake" in b.log_path.read_text()
