"""`trnd bench disagg`: what disaggregation costs and what pipelining buys, in one run.

1. NIXL WRITE throughput between two processes (UCX) for batches of 64 KiB - 64 MiB, against a plain
   in-process memcpy of the same bytes.
2. TTFT for long prompts: a local prefill + decode deployment vs the aggregated server, same model.
3. The same deployment with pipelining off (KV written only after the last chunk).

The three servers are up at once and take the same prompt in turn (the order rotating each repetition), so a
host whose speed drifts by 15-25% over minutes (these shared 2-core machines) slows all three alike: measured one
after the other, the servers differed by a "fixed gap" of 100-450 ms that was that drift. An idle server costs the
busy one nothing measurable (docs/RESULTS-history.md, "The pair's TTFT gap, explained").
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from trnd.bench import cpu_line

from trnd.procs import free_port, wait_ready

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


# -- 1. NIXL throughput ------------------------------------------------------------------------------

def _target(conn, nbytes: int) -> None:
    import torch

    from trnd.transfer.nixl import KVAgent

    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent = KVAgent("bench-dst", [buf])
    conn.send((agent.metadata(), buf.data_ptr()))
    conn.recv()  # until the writer is done
    agent.close()


def nixl_throughput(sizes: list[int], reps: int = 5) -> list[dict]:
    import numpy as np
    import torch

    from trnd.transfer.nixl import KVAgent

    biggest = max(sizes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, biggest))
    proc.start()
    meta, remote_base = parent.recv()
    src = torch.randint(0, 255, (biggest,), dtype=torch.uint8)
    agent = KVAgent("bench-src", [src])
    peer = agent.add_peer(meta)
    rows = []
    try:
        for n in sizes:
            page = 64 << 10  # pages of 64 KiB, one descriptor each, one transfer per batch
            k = max(1, n // page)
            s = np.array([(src.data_ptr() + i * page, min(page, n), 0) for i in range(k)], dtype=np.uint64)
            d = np.array([(remote_base + i * page, min(page, n), 0) for i in range(k)], dtype=np.uint64)
            times = []
            for r in range(reps + 1):
                t = time.perf_counter()
                h = agent.write(peer, s, d, b"")
                while (st := agent.state(h)) == "PROC":
                    pass
                agent.release(h)
                if st != "DONE":
                    raise RuntimeError(f"NIXL transfer ended {st}")
                if r:
                    times.append(time.perf_counter() - t)
            a, b = src.numpy()[:n], np.zeros(n, dtype=np.uint8)
            np.copyto(b, a)  # warm: pages faulted in, as the registered NIXL buffers are
            mtimes = []
            for _ in range(reps):  # a plain single-threaded memcpy
                t = time.perf_counter()
                np.copyto(b, a)
                mtimes.append(time.perf_counter() - t)
            nx, mc = statistics.median(times), statistics.median(mtimes)
            rows.append({"bytes": n, "nixl_gbs": n / nx / 1e9, "memcpy_gbs": n / mc / 1e9, "ratio": mc / nx})
    finally:
        parent.send("done")
        proc.join(10)
        agent.close()
    return rows


# -- 2 and 3. TTFT ------------------------------------------------------------------------------------

def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def ttft(port: int, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token (prefix cache off)."""
    t = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                      json={"model": "m", "prompt": prompt, "max_tokens": 2, "stream": True,
                            "ignore_eos": True, "temperature": 0}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t
    raise RuntimeError(f"no token from the server on port {port}")


def start(kind: str, model: str, point: str, kv_gb: float, tmp: Path, threads: int | None, link=None,
          backend: str = "ucx", dtype: str | None = None, kv_cache_dtype: str | None = None
          ) -> tuple[list, int, str | None]:
    """One server; returns its processes, its API port and (a pair) its prefill's admin address. With a
    link (bench/link.py), the pair's prefill runs in the link's namespace and its pages cross the veth."""
    exe = [sys.executable, "-m", "trnd"]
    th = ["--threads", str(threads)] if threads else []
    th += ["--dtype", dtype] if dtype else []
    th += ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else []
    port = free_port()
    log = open(tmp / f"{kind}.log", "w")
    if kind == "aggregated":
        procs = [subprocess.Popen([*exe, "serve", "--aggregated", "--model", model, "--port", str(port),
                                   "--served-model-name", "m", "--no-prefix-cache", "--kv-memory-gb", str(kv_gb),
                                   "--page-size", "64", "--chunk-size", "2048", "--token-budget", "2048",
                                   "--max-model-len", "131072", *th], stdout=log, stderr=subprocess.STDOUT)]
        admin = None
    else:
        secret = tmp / "secret"
        secret.write_text(secrets.token_hex(16))
        cp, ap = free_port(), free_port()
        host = link.ns_addr if link is not None else "127.0.0.1"
        common = ["--model", model, "--point", point, "--secret-file", str(secret), "--kv-memory-gb", str(kv_gb),
                  "--no-prefix-cache", "--transfer-backend", backend, *th]
        extra = ["--no-pipeline"] if kind == "disagg-nopipe" else []
        env = os.environ | (link.env(backend) if link is not None else {})
        pre = [*exe, "prefill", *common, "--host", host, "--control-port", str(cp), "--admin-port", str(ap), *extra]
        procs = [subprocess.Popen(link.wrap(pre) if link is not None else pre, stdout=log, stderr=subprocess.STDOUT,
                                  env=env),
                 subprocess.Popen([*exe, "decode", *common, "--port", str(port), "--prefill", f"{host}:{cp}",
                                   "--served-model-name", "m"], stdout=log, stderr=subprocess.STDOUT, env=env)]
        admin = f"{host}:{ap}"
    try:
        wait_ready(port, procs)
    except RuntimeError as e:
        _stop(procs)
        tail = (tmp / f"{kind}.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{kind}: {e}; the end of its log: " + " | ".join(tail)) from None
    return procs, port, admin


def main(args) -> int:
    import contextlib

    import torch

    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    lengths = [int(x) for x in (args.prompt_tokens or args.lengths).split(",")]
    print(f"trnd bench disagg: model {model}, point {args.point}, prompts {lengths}, {os.cpu_count()} cores, "
          f"transfer backend {args.transfer_backend}" + (f", kv {args.kv_cache_dtype}" if args.kv_cache_dtype else ""),
          flush=True)
    print(cpu_line(), flush=True)
    link = contextlib.nullcontext()
    if args.netns:
        from trnd.bench.link import Link, unavailable

        why = unavailable()
        if why:
            print(f"--netns: skipped, {why}")
            return 0
        link = Link(rate=args.rate, delay_ms=args.delay_ms, loss_pct=args.loss)
    else:
        print("\n1. NIXL WRITE (UCX, two processes) vs memcpy, one transfer of 64 KiB descriptors per batch")
        print(f"{'batch':>10}{'NIXL GB/s':>12}{'memcpy GB/s':>13}{'NIXL/memcpy':>13}")
        for r in nixl_throughput(SIZES):
            print(f"{r['bytes'] >> 10:>8}Ki{r['nixl_gbs']:>12.2f}{r['memcpy_gbs']:>13.2f}{r['ratio']:>12.2f}x")
    g = torch.Generator().manual_seed(0)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = {n: torch.randint(10, min(vocab, 15000), (n,), generator=g).tolist() for n in lengths}
    kinds = ("aggregated", "disagg", "disagg-nopipe")
    runs: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in kinds}
    handoffs: dict[str, dict] = {}
    servers: dict[str, tuple[list, int, str | None]] = {}
    with tempfile.TemporaryDirectory() as tmp, link as lk:
        if lk is not None:
            print(f"\nlink: prefill in network namespace {lk.ns} ({lk.ns_addr}), decode here ({lk.host_addr}), "
                  f"veth shaped: {lk.shaping}; pages over TCP on the veth", flush=True)
        try:
            for kind in kinds:
                servers[kind] = start(kind, model, args.point, args.kv_memory_gb, Path(tmp), args.threads, lk,
                                      args.transfer_backend, args.dtype, args.kv_cache_dtype)
                ttft(servers[kind][1], prompts[lengths[0]][:256])  # warm-up
            for rep in range(args.reps):
                for n in lengths:
                    for kind in kinds[rep % 3:] + kinds[:rep % 3]:  # each server first in turn
                        runs[kind][n].append(ttft(servers[kind][1], prompts[n]))
                print(f"  repetition {rep + 1}: " + "; ".join(
                    f"{k} " + ", ".join(f"{runs[k][n][-1] * 1e3:.0f}" for n in lengths) for k in kinds), flush=True)
            for kind, (_, _, admin) in servers.items():
                if admin is not None:
                    handoffs[kind] = httpx.get(f"http://{admin}/admin/state", timeout=10).json()["transfers"]
        finally:
            for procs, _, _ in servers.values():
                _stop(procs)
    med = {k: {n: statistics.median(v) for n, v in runs[k].items()} for k in kinds}

    def paired(kind: str, n: int) -> float:  # median over repetitions of this server's TTFT / the aggregated one's
        return statistics.median(x / a for x, a in zip(runs[kind][n], runs["aggregated"][n]))

    print(f"\n2-3. TTFT (median of {args.reps}, the three servers up at once and taking each prompt in turn; "
          "ratio: median of the per-prompt ratios), prefix cache off")
    print(f"{'prompt':>8}{'aggregated':>12}{'disagg':>10}{'ratio':>8}{'no pipeline':>13}{'ratio':>8}")
    for n in lengths:
        a, d, np_ = med["aggregated"][n], med["disagg"][n], med["disagg-nopipe"][n]
        print(f"{n:>8}{a * 1e3:>10.0f}ms{d * 1e3:>8.0f}ms{paired('disagg', n):>7.2f}x{np_ * 1e3:>11.0f}ms"
              f"{paired('disagg-nopipe', n):>7.2f}x")
    print("\nThe handoff inside the roles (prefill's /admin/state, every transfer of the run):")
    for kind, t in handoffs.items():
        mb, ms = t["bytes"] / 1e6, t["xfer_ms"]
        print(f"  {kind}: {t['xfers']} transfers, {t.get('descriptors', 0)} descriptors, {mb:.0f} MB, {ms:.0f} ms "
              f"posted to done ({t['post_ms']:.0f} ms inside the post call): {mb / max(ms, 1e-3):.3f} GB/s")
    if args.netns and "disagg-nopipe" in handoffs:
        _hidden(args.rate, lengths, med, handoffs["disagg-nopipe"], args.reps + 1)
    return 0


def rate_bytes(rate: str) -> float:
    """tc's rate ("1gbit", "10gbit", "500mbit") in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[:-len(u)]) * f / 8
    raise ValueError(f"rate {rate!r}: a number and kbit, mbit or gbit")


def _hidden(rate: str, lengths: list[int], med: dict, nopipe: dict, prompts_per_len: int) -> None:
    """How much of the transfer the pipelined pair hid under compute, against what compute and link times
    predict. The no-pipeline pair posts one transfer per prompt after the whole prefill: its TTFT minus the
    aggregated server's is the transfer (and the hops); the pipelined pair hides a part of that. With n
    chunks of compute C each and link time L for the prompt, at most min((n-1) C, L) can be hidden."""
    link = rate_bytes(rate)
    gbs = nopipe["bytes"] / max(nopipe["xfer_ms"], 1e-3) / 1e6
    print(f"\nachieved bandwidth of the no-pipeline pair's transfers (one per prompt, posted to done): "
          f"{gbs:.3f} GB/s = {gbs * 1e9 / link:.0%} of the shaped {rate}")
    print(f"{'prompt':>8}{'KV MB':>8}{'link s':>8}{'exposed (nopipe-agg)':>22}{'hidden':>8}{'predicted':>11}")
    per_token = nopipe["bytes"] / max(1, prompts_per_len * sum(lengths))
    for n in lengths:
        kv = per_token * n
        link_s = kv / link
        after = med["disagg-nopipe"][n] - med["aggregated"][n]
        hidden = (med["disagg-nopipe"][n] - med["disagg"][n]) / max(after, 1e-9)
        chunks = -(-n // 2048)
        compute = med["aggregated"][n]
        predicted = min(compute * (chunks - 1) / chunks, link_s) / max(link_s, 1e-9)
        print(f"{n:>8}{kv / 1e6:>8.0f}{link_s:>8.2f}{after:>20.2f} s{hidden:>8.0%}{predicted:>11.0%}")
