"""`trnd bench l3`: the L3 tier on `trnd store` vs on Mooncake Store, same pages, same machine, one run.

1. Bytes: an in-process client of each backend writes N canonical pages of the model's geometry and reads
   them back (batches of --batch pages): GB/s of the reads and the writes, every read checked (trnd store:
   NIXL READ into the pool + blake2b; Mooncake: get_batch + blake2b). The pages are the servers' own: the
   dtype resolved as the engine resolves it (`auto` is float32 on a CPU without native bf16), the serve
   default page size. Any other geometry would fix a `trnd store`'s slot size (its first client does) at a
   size the server's pages do not have, and the store would refuse the server.
2. An L3 hit as a client sees it: an aggregated server on each backend answers a prompt (its pages go to
   L3 when it finishes), drops its device cache (/admin/evict), and answers it again: TTFT of that second
   answer (the history loaded from L3) beside TTFT of computing it cold. A server that loaded no page back
   (a store that refused it, writes that never landed) fails the bench, naming why: its "hit" would be a
   recompute.
Mooncake runs as its master plus one store node (`mooncake_client`) lending the memory, as in
tests/procs/test_mooncake.py; the servers lend none.
"""

from __future__ import annotations

import json
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch

from trnd.bench import cpu_line
from trnd.bench.disagg import _stop
from trnd.procs import free_port, wait_ready
from trnd.transfer.plan import Layout


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="model dir or preset (default small)")
    p.add_argument("--pages", type=int, default=256, help="pages written and read per backend (bytes test)")
    p.add_argument("--batch", type=int, default=32, help="pages per read or write call")
    p.add_argument("--prompt", type=int, default=2048, help="tokens of the L3-hit prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", default="trnd,mooncake")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="the servers' dtype, and so the pages' (default auto: what trnd serve picks on this CPU)")


def _mooncake(tmp: Path, gb: float) -> tuple[list, SimpleNamespace]:
    exe = Path(sys.executable).with_name("mooncake_master")
    exe = exe if exe.exists() else Path(shutil.which("mooncake_master") or "mooncake_master")
    rpc, http = free_port(), free_port()
    log = open(tmp / "mooncake.log", "w")
    master = subprocess.Popen([str(exe), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                               "--http_metadata_server_host=127.0.0.1", f"--metrics_port={free_port()}"],
                              stdout=log, stderr=subprocess.STDOUT)  # metrics: its default port is fixed (9003)
    time.sleep(1.5)
    node = subprocess.Popen([str(exe.with_name("mooncake_client")), f"--global_segment_size={int(gb * 1024)}MB",
                             "--local_buffer_size=64MB", f"--master_server_address=127.0.0.1:{rpc}",
                             f"--metadata_server=http://127.0.0.1:{http}/metadata", "--host=127.0.0.1",
                             f"--port={free_port()}", "--protocol=tcp"], stdout=log, stderr=subprocess.STDOUT)
    time.sleep(2.0)
    cfg = SimpleNamespace(backend="mooncake", master=f"127.0.0.1:{rpc}", metadata_server=f"http://127.0.0.1:{http}/metadata",
                          protocol="tcp", device="", local_hostname="127.0.0.1", segment_gb=0.0, buffer_gb=0.25)
    return [node, master], cfg


def _trnd_store(tmp: Path, gb: float) -> tuple[list, str, Path]:
    secret = tmp / "secret"
    secret.write_text(secrets.token_hex(16))
    cp, ap = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "store", "--secret-file", str(secret), "--control-port",
                             str(cp), "--admin-port", str(ap), "--memory-gb", str(gb)],
                            stdout=open(tmp / "store.log", "w"), stderr=subprocess.STDOUT)
    wait_ready(ap, [proc], timeout=120)
    return [proc], f"127.0.0.1:{cp}", secret


def server_pages(model: str, dtype: str, num_pages: int) -> tuple[torch.Tensor, Layout]:
    """A pool of `num_pages` pages and its layout as `trnd serve --aggregated --model M --dtype D` keeps them on
    this host (tp=1): the dtype resolved by the backend as the engine resolves it, the serve default page size."""
    from trnd.backends import resolve_dtype
    from trnd.config import Shapes
    from trnd.engine.runner import alloc_kv, pool_layout
    from trnd.model.config import ModelConfig

    mc = ModelConfig.from_dir(model, resolve_dtype(dtype)[0])
    page_size, heads = Shapes().page_size, mc.pool.heads  # the pool kind: GQA's K and V heads, or MLA's latent rows
    pool = alloc_kv(mc, heads, num_pages, page_size)
    return pool, pool_layout(mc, page_size, pool.dtype, [(0, heads)])


def _bits(pool: torch.Tensor) -> torch.Tensor:
    """The pool as integers of its element size: random bits compared as bits (random floats include NaNs)."""
    return pool.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[pool.element_size()])


def _bytes(kind: str, model: str, args, tmp: Path, svc) -> dict:
    """GB/s of batched writes and reads of the servers' canonical pages through one backend's client."""
    from trnd.cache.hashing import page_hashes

    n = args.pages
    pool, lay = server_pages(model, args.dtype, 2 * n)
    dtype = pool.dtype
    _bits(pool).random_()
    hashes = page_hashes(list(range(n * lay.page_size)), lay.page_size, f"bench-l3-{time.time_ns()}")
    if kind == "mooncake":
        from trnd.store.mooncake import MooncakeTier

        client = MooncakeTier(svc, lay, [pool], "bench", dtype=str(dtype).removeprefix("torch."), deadline_s=60)
    else:
        from trnd.store.client import StoreClient
        from trnd.transfer.nixl import KVAgent

        addr, secret = svc
        client = StoreClient([addr], secret.read_bytes().strip(), KVAgent(f"bench-{secrets.token_hex(4)}", [pool]),
                             lay, [pool], "bench", dtype=str(dtype).removeprefix("torch."), deadline_s=60)
        time.sleep(1.0)  # connected
    try:
        page_bytes = lay.page_bytes(0)
        b = args.batch
        t0 = time.perf_counter()
        wrote = sum(client.write(hashes[i:i + b], list(range(i, min(i + b, n)))).result(120) for i in range(0, n, b))
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        read = sum(client.read(hashes[i:i + b], list(range(n + i, n + min(i + b, n)))).result(120)
                   for i in range(0, n, b))
        tr = time.perf_counter() - t0
        bits = _bits(pool)
        same = torch.equal(bits[:read], bits[n:n + read])
    finally:
        client.close()
    return {"pages": n, "page_bytes": page_bytes, "written": wrote, "read": read, "identical": same,
            "write_GBps": wrote * page_bytes / tw / 1e9, "read_GBps": read * page_bytes / tr / 1e9}


def _ttft(port: int, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=600, json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def _remote(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=30).json()["tiers"]["remote"]


def _connected(port: int, log: Path, timeout: float = 60) -> None:
    """Wait for the server's L3 client to reach every store; a refusal (or no connection in time) is an error
    naming the store's reason, not a run whose every "hit" is a recompute."""
    deadline = time.monotonic() + timeout
    while True:
        stores = _remote(port)["stores"]
        if all(s["connected"] for s in stores):
            return
        refused = [f"{s['addr']}: {s['refused']}" for s in stores if s.get("refused")]
        if refused or time.monotonic() > deadline:
            why = "; ".join(refused) or "; ".join(f"{s['addr']}: {s.get('error') or 'not connected'}" for s in stores)
            raise RuntimeError(f"the server's L3 client has no store ({why}); {log.name}: "
                               f"{log.read_text()[-1500:]}")
        time.sleep(0.2)


def _landed(port: int, written: int, timeout: float = 60) -> None:
    """Wait until the server's L3 writes have reached `written` pages (bounded: a write that failed is a miss)."""
    deadline = time.monotonic() + timeout
    while _remote(port)["pages_written"] < written and time.monotonic() < deadline:
        time.sleep(0.05)


def _hit(kind: str, model: str, args, tmp: Path, svc) -> dict:
    """TTFT of a prompt computed cold vs loaded back from L3 (device cache dropped in between)."""
    from trnd.model.config import ModelConfig

    port = free_port()
    extra = (["--remote-config", json.dumps(vars(svc))] if kind == "mooncake"
             else ["--config", str(_store_cfg(tmp, *svc))])
    log = tmp / f"serve-{kind}.log"
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", model, "--port",
                             str(port), "--dtype", args.dtype, "--log-level", "warning", *extra],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    page_size = server_pages(model, args.dtype, 1)[1].page_size
    want = (args.prompt + 1) // page_size  # full pages written: the prompt's and the first token's KV (max_tokens 2)
    hits = (args.prompt - 1) // page_size  # pages a rerun can load: its last prompt token is computed for its logits
    vocab = min(15000, ModelConfig.from_dir(model).vocab_size - 1)
    try:
        wait_ready(port, [proc], timeout=600)
        _connected(port, log)
        g = torch.Generator().manual_seed(7)
        cold, hit = [], []
        written = 0  # every answer writes its `want` full pages to L3 when it ends (present ones count as written)
        for _ in range(args.repeats):
            prompt = torch.randint(10, vocab, (args.prompt,), generator=g).tolist()
            cold.append(_ttft(port, prompt))
            written += want
            _landed(port, written)  # _ttft returns at the first token: the pages go to L3 after the answer ends
            httpx.post(f"http://127.0.0.1:{port}/admin/evict", timeout=60)
            hit.append(_ttft(port, prompt))
            written += want
            _landed(port, written)  # the rerun's own write, before the next prompt is timed
        remote = _remote(port)
    finally:
        _stop([proc])
    loaded = sum(s.get("pages_loaded", 0) for s in remote["stores"])
    if loaded == 0:
        raise RuntimeError(f"the server loaded no page back from L3 ({remote['pages_written']} pages written, "
                           f"{want} a prompt), so its L3 hit would be a recompute; "
                           f"its L3 client: {remote}")
    return {"ttft_cold_p50": statistics.median(cold), "ttft_l3_hit_p50": statistics.median(hit),
            "pages_loaded": loaded, "pages_expected": hits * args.repeats, "pages_written": remote["pages_written"]}


def _store_cfg(tmp: Path, addr: str, secret: Path) -> Path:
    cfg = tmp / "serve-store.toml"
    cfg.write_text(f'store = ["{addr}"]\nsecret_file = "{secret}"\n')
    return cfg


def main(args) -> int:
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    pool, lay = server_pages(model, args.dtype, 1)
    print(f"trnd bench l3: model {model}, {args.pages} pages ({str(pool.dtype).removeprefix('torch.')}, "
          f"{lay.page_size} tokens, {lay.page_bytes(0)} B: the servers' pages) in batches of {args.batch}; L3-hit "
          f"TTFT at {args.prompt} prompt tokens x {args.repeats}", flush=True)
    print(cpu_line(), flush=True)
    results, failed = {}, []
    for kind in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix=f"trnd-bench-l3-{kind}-") as tmp:
            tmp = Path(tmp)
            if kind == "mooncake":
                procs, svc = _mooncake(tmp, 2.0)
            else:
                procs, addr, secret = _trnd_store(tmp, 2.0)
                svc = (addr, secret)
            try:
                res = _bytes(kind, model, args, tmp, svc)
                res.update(_hit(kind, model, args, tmp, svc))
            except RuntimeError as e:
                print(f"trnd bench l3: {kind}: {e}", file=sys.stderr, flush=True)
                failed.append(kind)
                continue
            finally:
                _stop(procs)
        results[kind] = res
        print(f"  {kind}: {res}", flush=True)
    names = list(results)
    print(f"\n{'metric':<30}" + "".join(f"{n:>14}" for n in names))
    for key in ("write_GBps", "read_GBps", "ttft_cold_p50", "ttft_l3_hit_p50", "pages_loaded", "pages_expected",
                "identical"):
        print(f"{key:<30}" + "".join(f"{results[n][key]:>14.3f}" if isinstance(results[n][key], float)
                                     else f"{str(results[n][key]):>14}" for n in names))
    return 1 if failed else 0
