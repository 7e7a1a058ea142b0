"""`trnd store` as real processes on loopback, with real NIXL agents: pages written by a TP=2 client
come back byte-identical (canonical layout) to a TP=1 client in another process and vice versa;
lookups count leading pages; rendezvous spreads pages over two stores; uncommitted and corrupt pages
are never served; a killed, stopped or restarted store is a miss within the deadline, never a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch

from trnd.cache.hashing import page_hashes
from trnd.store import protocol as S
from trnd.transfer.nixl import KVAgent
from trnd.transfer.plan import Layout
from trnd.store.client import StoreClient

from tests.launch import admin_state, free_port, stop, wait_for, wait_ready

L, H, PS, HD = 2, 4, 4, 8  # canonical page: 2 layers * k|v * 4 heads * 4 slots * 8 dims * 2 bytes = 1 KiB
NUM_PAGES = 64
DEADLINE = 5.0  # generous: the CI machine is small and busy; a store that misses it is a (flaky) miss
FAULT_DEADLINE = 2.0  # where a test waits out the deadline on purpose
SECRET = "store-test-secret-0123456789"


def layout(tp: int, head_dim: int = HD) -> Layout:
    return Layout(L, PS, head_dim, 2, tuple((r * H // tp, (r + 1) * H // tp) for r in range(tp)))


def new_pools(tp: int, head_dim: int = HD) -> list[torch.Tensor]:
    return [torch.zeros(NUM_PAGES, L, 2, H // tp, PS, head_dim, dtype=torch.bfloat16) for _ in range(tp)]


def fill(pools, pages, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in pools:
        p.view(torch.int16)[pages] = torch.randint(-32768, 32767, (len(pages), *p.shape[1:]), dtype=torch.int16,
                                                   generator=g)


def canonical(pools, page: int) -> bytes:
    """A page in the tp=1 layout: every rank's heads side by side in each (layer, k|v) block."""
    return torch.cat([p[page] for p in pools], dim=2).contiguous().view(torch.int16).numpy().tobytes()


def hashes(n: int, ns: str, seed: int = 0) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return page_hashes(torch.randint(0, 50000, (n * PS,), generator=g).tolist(), PS, ns)


class StoreProc:
    def __init__(self, secret_file, memory_gb: float = 0.01):
        self.secret_file, self.memory_gb = secret_file, memory_gb
        self.cp, self.ap = free_port(), free_port()
        self.proc = None
        self.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.cp}"

    def start(self) -> None:
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trnd", "store", "--secret-file", str(self.secret_file), "--memory-gb",
             str(self.memory_gb), "--control-port", str(self.cp), "--admin-port", str(self.ap)],
            env={**os.environ, "TRND_STORE_DEBUG": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait(self) -> StoreProc:
        wait_ready(self.ap, self.proc, timeout=60)
        return self

    def state(self) -> dict:
        return admin_state(self.ap)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{self.ap}{path}", json=body, timeout=5)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> str:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        out = stop(self.proc)
        self.proc.stdout.close()
        return out


class Client:
    """An in-process store client with its own NIXL agent and pools."""

    def __init__(self, addrs, tp: int, ns: str, head_dim: int = HD, secret: str = SECRET,
                 deadline: float = DEADLINE):
        self.pools = new_pools(tp, head_dim)
        self.agent = KVAgent(f"test-{uuid.uuid4().hex[:8]}", self.pools)
        self.c = StoreClient(addrs, secret.encode(), self.agent, layout(tp, head_dim), self.pools, ns,
                             dtype="bfloat16", deadline_s=deadline)

    def connected(self, n: int | None = None, timeout: float = 20) -> bool:
        want = n if n is not None else len(self.c.stores)
        return wait_for(lambda: sum(s["connected"] for s in self.c.state()["stores"]) >= want, timeout)

    def close(self) -> None:
        self.c.close()
        self.agent.close()


CLIENT_SCRIPT = r"""
import json, sys, torch
from trnd.transfer.nixl import KVAgent
from trnd.transfer.plan import Layout
from trnd.store.client import StoreClient
cfg = json.loads(sys.argv[1])
L, H, PS, HD, N, tp = cfg["L"], cfg["H"], cfg["PS"], cfg["HD"], cfg["N"], cfg["tp"]
pools = [torch.zeros(N, L, 2, H // tp, PS, HD, dtype=torch.bfloat16) for _ in range(tp)]
agent = KVAgent(cfg["name"], pools)
lay = Layout(L, PS, HD, 2, tuple((r * H // tp, (r + 1) * H // tp) for r in range(tp)))
client = StoreClient(cfg["addrs"], cfg["secret"].encode(), agent, lay, pools, cfg["ns"], dtype="bfloat16",
                     deadline_s=cfg["deadline"])
def canonical(p):
    return torch.cat([x[p] for x in pools], dim=2).contiguous().view(torch.int16).numpy().tobytes().hex()
print("@@", json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    hs = [bytes.fromhex(h) for h in cmd.get("hashes", [])]
    op = cmd["op"]
    if op == "lookup":
        out = {"n": client.lookup(hs).result()}
    elif op == "read":
        n = client.read(hs, cmd["pages"]).result()
        out = {"n": n, "pages": [canonical(p) for p in cmd["pages"][:n]]}
    elif op == "fill":
        g = torch.Generator().manual_seed(cmd["seed"])
        for x in pools:
            x.view(torch.int16)[cmd["pages"]] = torch.randint(-32768, 32767, (len(cmd["pages"]), *x.shape[1:]),
                                                              dtype=torch.int16, generator=g)
        out = {"pages": [canonical(p) for p in cmd["pages"]]}
    elif op == "write":
        out = {"n": client.write(hs, cmd["pages"]).result()}
    elif op == "connected":
        out = {"n": sum(s["connected"] for s in client.state()["stores"])}
    else:
        break
    print("@@", json.dumps(out), flush=True)
client.close()
agent.close()
"""


class ClientProc:
    """A store client in its own process (its own NIXL agent and pools), driven by JSON lines."""

    def __init__(self, addrs, tp: int, ns: str):
        cfg = {"L": L, "H": H, "PS": PS, "HD": HD, "N": NUM_PAGES, "tp": tp, "addrs": addrs, "secret": SECRET,
               "ns": ns, "deadline": DEADLINE, "name": f"proc-{uuid.uuid4().hex[:8]}"}
        self.proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self._reply()["ready"]

    def _reply(self) -> dict:
        """The next protocol line (NIXL logs to stdout too)."""
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
        raise AssertionError("client process died")

    def call(self, op: str, **kw) -> dict:
        if "hashes" in kw:
            kw["hashes"] = [h.hex() for h in kw["hashes"]]
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "secret"
    path.write_text(SECRET)
    return path


@pytest.fixture(scope="module")
def store(secret_file):
    s = StoreProc(secret_file).wait()
    yield s
    s.close()


@pytest.fixture(scope="module")
def ns():
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def proc_b(store, ns):
    """Client B: TP=1, in its own process."""
    b = ClientProc([store.addr], 1, ns)
    assert wait_for(lambda: b.call("connected")["n"] == 1, 20)
    yield b
    b.close()


@pytest.fixture(scope="module")
def client_a(store, ns):
    """Client A: TP=2 (two ranks' pools), in this process."""
    a = Client([store.addr], 2, ns)
    assert a.connected()
    yield a
    a.close()


# -- tests ------------------------------------------------------------------------------------------

def test_pages_cross_tp_layouts_byte_identical(client_a, proc_b, store, ns):
    a = client_a
    hs = hashes(6, ns, seed=1)
    assert a.c.lookup(hs).result() == 0
    fill(a.pools, list(range(10, 16)), seed=1)
    assert a.c.write(hs, list(range(10, 16))).result() == 6
    assert a.c.write(hs[:3], [10, 11, 12]).result() == 3  # already there: nothing moves, still held
    # lookups count LEADING pages only
    other = hashes(2, ns, seed=99)
    assert proc_b.call("lookup", hashes=hs)["n"] == 6
    assert proc_b.call("lookup", hashes=hs + other)["n"] == 6
    assert proc_b.call("lookup", hashes=[other[0]] + hs)["n"] == 0
    # B (tp=1) reads A's (tp=2) pages: the same canonical bytes
    got = proc_b.call("read", hashes=hs, pages=[40, 41, 42, 43, 44, 45])
    assert got["n"] == 6
    assert [bytes.fromhex(p) for p in got["pages"]] == [canonical(a.pools, p) for p in range(10, 16)]
    # and back: B writes, A reads into its two ranks' pools
    hs2 = hashes(4, ns, seed=2)
    want = [bytes.fromhex(p) for p in proc_b.call("fill", pages=[1, 2, 3, 4], seed=7)["pages"]]
    assert proc_b.call("write", hashes=hs2, pages=[1, 2, 3, 4])["n"] == 4
    assert a.c.read(hs2, [20, 21, 22, 23]).result() == 4
    assert [canonical(a.pools, p) for p in range(20, 24)] == want
    st = store.state()
    assert st["slots"]["used"] >= 10 and st["leases"] == 0 and st["reservations"] == 0
    assert st["counters"]["bytes_in"] == 10 * 1024 and st["counters"]["hits"] >= 6 + 6 + 4
    assert st["slot_bytes"] == 1024 and {c["namespace"].split("|")[0] for c in st["clients"]} == {ns}
    cs = a.c.state()
    assert cs["stores"][0]["pages_loaded"] == 4 and cs["fenced_pages"] == 0 and cs["in_flight"] == 0


def test_reserved_but_uncommitted_is_never_served(client_a, store, ns):
    """Two-phase put through the raw protocol: a reservation is invisible to lookups and blocks other
    writers; a commit whose checksum does not match the slot's bytes is dropped."""
    a = client_a
    hs = hashes(3, ns, seed=3)
    m = a.c.manifest

    async def scenario():
        host, port = store.addr.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(port))
        ch = S.StoreChannel(r, w, SECRET.encode())
        await ch.answer(lambda nonce: S.StoreHello(m, "raw", nonce))  # the store's Challenge, then our Hello
        wel = await ch.recv(strict=True)
        assert isinstance(wel, S.StoreWelcome)
        await ch.send(S.Reserve(1, hs))
        res = await ch.recv()
        assert isinstance(res, S.Reserved) and all(s >= 0 for s in res.slots)
        assert await asyncio.wrap_future(a.c.lookup(hs)) == 0  # reserved, not committed: not served
        await ch.send(S.Lookup(2, hs, True))
        found = await ch.recv()
        assert found.slots == [] and found.lease == 0
        fill(a.pools, [30, 31, 32], seed=3)
        assert await asyncio.wrap_future(a.c.write(hs, [30, 31, 32])) == 0  # another writer holds them
        # commit without writing: the slots hold whatever was there, not these bytes
        await ch.send(S.Commit(3, res.reservation, hs, [S.checksum(b"not the page")] * 3))
        done = await ch.recv()
        assert isinstance(done, S.Committed) and done.ok == [False, False, False]
        assert await asyncio.wrap_future(a.c.lookup(hs)) == 0
        ch.close()

    asyncio.run(scenario())
    assert a.c.write(hs, [30, 31, 32]).result() == 3  # the rejected reservation freed its slots
    assert a.c.lookup(hs).result() == 3
    assert store.state()["counters"]["rejected"] >= 3


def test_corrupt_slot_is_a_miss_and_dropped(client_a, proc_b, store, ns):
    a = client_a
    hs = hashes(4, ns, seed=4)
    fill(a.pools, [33, 34, 35, 36], seed=4)
    assert a.c.write(hs, [33, 34, 35, 36]).result() == 4
    assert store.post("/admin/debug/corrupt", {"hash": hs[2].hex()}).status_code == 200
    before = store.state()["counters"]["corrupt_dropped"]
    got = proc_b.call("read", hashes=hs, pages=[50, 51, 52, 53])
    assert got["n"] == 2  # pages 0 and 1 verified; page 2's bytes failed the checksum
    assert [bytes.fromhex(p) for p in got["pages"]] == [canonical(a.pools, p) for p in (33, 34)]
    assert wait_for(lambda: store.state()["counters"]["corrupt_dropped"] == before + 1)
    assert proc_b.call("lookup", hashes=hs)["n"] == 2  # the store dropped it
    assert a.c.write(hs, [33, 34, 35, 36]).result() == 4  # and takes a good copy again
    assert proc_b.call("read", hashes=hs, pages=[50, 51, 52, 53])["n"] == 4


class HeldAgent:
    """A real KVAgent whose transfers look unfinished until `hold` is cleared: a READ that outlives the
    deadline, on demand."""

    def __init__(self, agent: KVAgent):
        self.a, self.hold = agent, True

    def __getattr__(self, name):
        return getattr(self.a, name)

    def state(self, handle) -> str:
        return "PROC" if self.hold else self.a.state(handle)


def test_read_outliving_its_deadline_fences_its_pages(client_a, store, ns):
    hs = hashes(3, ns, seed=10)
    fill(client_a.pools, [37, 38, 39], seed=10)
    assert client_a.c.write(hs, [37, 38, 39]).result() == 3
    pools = new_pools(1)
    agent = KVAgent(f"held-{uuid.uuid4().hex[:6]}", pools)
    held = HeldAgent(agent)
    c = StoreClient([store.addr], SECRET.encode(), held, layout(1), pools, ns, dtype="bfloat16",
                    deadline_s=FAULT_DEADLINE)
    try:
        assert wait_for(lambda: c.state()["stores"][0]["connected"], 20)
        t0 = time.monotonic()
        assert c.read(hs, [5, 6, 7]).result(timeout=FAULT_DEADLINE + 1) == 0  # the deadline passed mid-READ
        assert time.monotonic() - t0 < FAULT_DEADLINE + 1
        assert c.fenced() == {5, 6, 7}  # NIXL may still write them: not to be reused yet
        assert wait_for(lambda: store.state()["leases"] == 0, 5)  # the lease went back anyway
        held.hold = False
        assert wait_for(lambda: not c.fenced(), 5)
        assert c.state()["in_flight"] == 0
        assert c.read(hs, [5, 6, 7]).result() == 3
        assert [canonical(pools, p) for p in (5, 6, 7)] == [canonical(client_a.pools, p) for p in (37, 38, 39)]
    finally:
        c.close()
        agent.close()


def test_mismatched_page_shape_or_secret_is_refused(store, ns, client_a):
    bad = Client([store.addr], 1, ns, head_dim=HD * 2)  # canonical page of 2 KiB: not this store's slots
    forged = Client([store.addr], 1, ns, secret="not-the-secret")
    try:
        assert wait_for(lambda: bad.c.state()["stores"][0]["refused"], 10)
        assert "page_bytes" in bad.c.state()["stores"][0]["refused"]
        t0 = time.monotonic()
        assert bad.c.lookup(hashes(2, ns)).result() == 0
        assert time.monotonic() - t0 < 0.5  # refused: an instant miss, not a wait
        assert wait_for(lambda: store.state()["counters"]["unauthenticated"] >= 1, 10)
        assert forged.c.lookup(hashes(2, ns)).result() == 0
        assert not forged.c.state()["stores"][0]["connected"]
    finally:
        bad.close()
        forged.close()


def test_rendezvous_spreads_pages_over_two_stores(secret_file, store, ns):
    s2 = StoreProc(secret_file).wait()
    space = f"{ns}-rv"
    w = Client([store.addr, s2.addr], 2, space)
    r = Client([store.addr, s2.addr], 1, space)
    try:
        assert w.connected() and r.connected()
        hs = hashes(32, space, seed=5)
        fill(w.pools, list(range(32)), seed=5)
        assert w.c.write(hs, list(range(32))).result() == 32
        owners = [w.c.owner(h) for h in hs]
        assert owners == [r.c.owner(h) for h in hs]  # every client agrees without talking
        held = [sum(n for k, n in s.state()["namespaces"].items() if k.startswith(space + "|")) for s in (store, s2)]
        assert held == [owners.count(0), owners.count(1)] and min(held) >= 8  # spread, all there
        assert r.c.lookup(hs).result() == 32
        assert r.c.read(hs, list(range(32, 64))).result() == 32
        assert [canonical(r.pools, p) for p in range(32, 64)] == [canonical(w.pools, p) for p in range(32)]
    finally:
        w.close()
        r.close()
        s2.close()


def test_stopped_store_is_a_miss_not_a_hang(client_a, store, ns):
    """SIGSTOP: the connection stays up but nothing answers (the module's store, resumed at the end)."""
    c = client_a
    hs = hashes(4, ns, seed=8)
    assert c.c.write(hs, [0, 1, 2, 3]).result() == 4
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert c.c.read(hs, [4, 5, 6, 7]).result(timeout=DEADLINE + 1) == 0
        assert time.monotonic() - t0 < DEADLINE + 1
        t0 = time.monotonic()
        assert c.c.lookup(hs).result() == 0  # skipped while it is slow: no second wait
        assert time.monotonic() - t0 < 0.5
        assert c.c.write(hashes(2, ns, seed=9), [0, 1]).result(timeout=DEADLINE + 1) == 0
        assert c.c.state()["stores"][0]["timeouts"] >= 1
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: c.c.lookup(hs).result() == 4, 20, interval=0.3)
    assert wait_for(lambda: store.state()["leases"] == 0, 10)


@pytest.mark.slow
def test_killed_store_is_a_miss_within_the_deadline_and_restart_serves_again(secret_file):
    x, y = StoreProc(secret_file), StoreProc(secret_file)
    x.wait(), y.wait()
    space = f"kill-{uuid.uuid4().hex[:6]}"
    c = Client([x.addr, y.addr], 2, space, deadline=FAULT_DEADLINE)
    try:
        assert c.connected()
        hs = hashes(16, space, seed=6)
        owners = [c.c.owner(h) for h in hs]
        # the victim owns a page after the first one: the survivor's earlier pages still count
        k = next(i for i in range(1, 16) if owners[i] != owners[0])
        victim, survivor = (x, y) if owners[k] == 0 else (y, x)
        fill(c.pools, list(range(16)), seed=6)
        assert c.c.write(hs, list(range(16))).result() == 16

        # mid-read: the victim answers late, then dies
        assert victim.post("/admin/debug/delay", {"s": 30}).status_code == 200
        t0 = time.monotonic()
        fut = c.c.read(hs, list(range(20, 36)))
        time.sleep(0.3)
        victim.kill()
        assert fut.result(timeout=FAULT_DEADLINE + 1) == k
        assert time.monotonic() - t0 < FAULT_DEADLINE + 1
        assert [canonical(c.pools, p) for p in range(20, 20 + k)] == [canonical(c.pools, p) for p in range(k)]
        assert wait_for(lambda: survivor.state()["leases"] == 0, 5)  # its lease was released
        t0 = time.monotonic()
        assert c.c.lookup(hs).result() == k  # a dead store: an instant miss
        assert time.monotonic() - t0 < 0.3

        # restart: empty, serving again once the client's backoff reconnects
        victim.start()
        victim.wait()
        assert wait_for(lambda: c.c.state()["stores"][owners[k]]["restarts"] == 1, 30)
        assert c.c.lookup(hs).result() == k  # the cache is gone, nothing else
        assert c.c.write(hs, list(range(16))).result() == 16
        assert c.c.read(hs, list(range(40, 56))).result() == 16

        # mid-write: the victim stalls the reservation, then dies
        hs2 = hashes(16, space, seed=7)
        owners2 = [c.c.owner(h) for h in hs2]
        mine = sum(1 for o in owners2 if o != owners[k])
        assert victim.post("/admin/debug/delay", {"s": 30}).status_code == 200
        t0 = time.monotonic()
        fut = c.c.write(hs2, list(range(16)))
        time.sleep(0.3)
        victim.kill()
        assert fut.result(timeout=FAULT_DEADLINE + 1) == mine  # the survivor's share is committed
        assert time.monotonic() - t0 < FAULT_DEADLINE + 1
        st = survivor.state()
        assert st["leases"] == 0 and st["reservations"] == 0
        assert c.c.state()["fenced_pages"] == 0
    finally:
        c.close()
        x.close()
        y.close()
