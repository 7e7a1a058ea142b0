"""`trnd bench tiers`: a multi-turn agentic replay against a local prefill + decode deployment, with
the tiers off (device prefix cache only), host L2, and host L2 + a remote L3 store, in one run.

Every session resends its whole, growing history each turn (its previous prompt, the answer, a new
message). Sessions take turns round after round, a few at a time, so between two turns of one session
all the others pass through the device pool, which is sized well below the working set: without lower
tiers a history is recomputed; with them it is loaded back.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from trnd.bench.disagg import _stop
from trnd.bench import cpu_line
from trnd.procs import free_port as _free_port, wait_ready


def start(kind: str, model: str, args, tmp: Path) -> tuple[list, int, dict]:
    exe = [sys.executable, "-m", "trnd"]
    secret = tmp / "secret"
    if not secret.exists():
        secret.write_text(secrets.token_hex(16))
    log = open(tmp / f"{kind}.log", "w")
    procs, extra = [], []
    if kind in ("l3", "l2+l3"):
        cp, ap = _free_port(), _free_port()
        procs.append(subprocess.Popen([*exe, "store", "--secret-file", str(secret), "--control-port", str(cp),
                                       "--admin-port", str(ap), "--memory-gb", str(args.store_gb)],
                                      stdout=log, stderr=subprocess.STDOUT))
        wait_ready(ap, procs)
        extra += ["store = [\"127.0.0.1:%d\"]" % cp]
    if kind in ("l2", "l2+l3"):
        extra += [f"host_cache_gb = {args.host_gb}"]
    port, admin = _free_port(), _free_port()
    cfg = tmp / f"{kind}.toml"
    cfg.write_text("\n".join([f'model = "{model}"', f"port = {port}", f'point = "{args.point}"',
                              f"prefill_admin_port = {admin}",
                              f"kv_memory_gb = {args.kv_memory_gb}", f'secret_file = "{secret}"',
                              'served_model_name = "m"', *extra]) + "\n")
    procs.append(subprocess.Popen([*exe, "serve", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT))
    wait_ready(port, procs)
    return procs, port, {"prefill_admin": admin}


async def one_turn(client: httpx.AsyncClient, port: int, prompt: list[int], gen: int) -> float:
    """Seconds to the first streamed token."""
    t = time.perf_counter()
    first = None
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=900,
                             json={"model": "m", "prompt": prompt, "max_tokens": gen, "stream": True,
                                   "ignore_eos": True, "temperature": 0}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn failed: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t
    return first if first is not None else time.perf_counter() - t


async def replay(port: int, sessions: list[list[int]], turns: int, growth: list[list[list[int]]], gen: int,
                 answers: list[list[int]], concurrency: int) -> dict:
    """Turns are taken session by session, round after round (turn t of sessions 0..S-1, then turn t+1),
    `concurrency` at a time, a session's next turn only after its previous one: between two turns of a
    session every other session passes through, so the working set cycles through the device pool."""
    ttft_first, ttft_cached = [], []
    hist = [list(s) for s in sessions]
    order = [(t, i) for t in range(turns) for i in range(len(sessions))]
    sem = asyncio.Semaphore(concurrency)

    async def turn(client, t: int, i: int, after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()
        prompt = hist[i] + growth[i][t]
        ttft = await one_turn(client, port, prompt, gen)
        (ttft_first if t == 0 else ttft_cached).append(ttft)
        hist[i] = prompt + answers[i]  # a fixed transcript: the same prompts for every configuration

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        events: dict[tuple[int, int], asyncio.Event] = {}
        tasks = []
        for t, i in order:
            events[t, i] = asyncio.Event()
            await sem.acquire()
            prev = events.get((t - 1, i))

            async def run(t=t, i=i, ev=events[t, i], after=prev):
                try:
                    await turn(client, t, i, after)
                finally:
                    ev.set()
                    sem.release()

            tasks.append(asyncio.create_task(run()))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0  # noqa: E731
    return {"tok_s": gen * len(order) / wall, "wall_s": wall,
            "ttft_cached_p50": statistics.median(ttft_cached) if ttft_cached else 0.0,
            "ttft_cached_p99": pct(ttft_cached, 0.99), "ttft_first_p50": statistics.median(ttft_first)}


KINDS = {"off": "tiers off", "l2": "host L2", "l3": "remote L3", "l2+l3": "L2 + L3"}


def _tier_tokens(st: dict, page_size: int) -> tuple[int, int]:
    """Tokens a role loaded from its host tier and from the remote store."""
    tiers = st.get("tiers") or {}
    host = (tiers.get("host") or {}).get("loaded", 0)
    remote = sum(s.get("pages_loaded", 0) for s in (tiers.get("remote") or {}).get("stores", []))
    return host * page_size, remote * page_size


def main(args) -> int:
    import torch

    from trnd.points import get_point
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    ps = get_point(args.point).page_size
    g = torch.Generator().manual_seed(0)
    vocab = 15000
    sessions = [torch.randint(10, vocab, (args.first,), generator=g).tolist() for _ in range(args.sessions)]
    growth = [[torch.randint(10, vocab, (args.growth,), generator=g).tolist() for _ in range(args.turns)]
              for _ in range(args.sessions)]
    answers = [torch.randint(10, vocab, (args.gen,), generator=g).tolist() for _ in range(args.sessions)]
    final = args.first + args.turns * args.growth + (args.turns - 1) * args.gen
    kinds = args.tiers.split(",")
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"trnd bench tiers: --tiers: unknown {k!r} (one of {', '.join(KINDS)})")
    print(f"trnd bench tiers: model {model}, point {args.point}, {args.sessions} sessions x {args.turns} turns "
          f"({args.concurrency} at a time), first prompt {args.first + args.growth}, +{args.growth + args.gen} "
          f"tokens a turn ({args.gen} generated); final prompt {final} tokens; working set "
          f"{args.sessions * final} tokens; device pool {args.kv_memory_gb} GiB per role", flush=True)
    print(cpu_line(), flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            procs, port, ports = start(kind, model, args, Path(tmp))
            try:
                results[kind] = asyncio.run(replay(port, sessions, args.turns, growth, args.gen, answers,
                                                   args.concurrency))
                st = httpx.get(f"http://127.0.0.1:{ports['prefill_admin']}/admin/state", timeout=10).json()
                r = results[kind]
                r["prefilled"] = st["stats"]["prefill_tokens"]
                r["pool_tokens"] = st["pages"]["total"] * ps
                r["host_tokens"], r["remote_tokens"] = _tier_tokens(st, ps)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                _stop(procs)
            print(f"  {kind:<6} device pool {r['pool_tokens']} tokens; {r['tok_s']:.1f} tok/s in {r['wall_s']:.0f} s, cached-turn TTFT p50 "
                  f"{r['ttft_cached_p50'] * 1e3:.0f} ms, prefilled {r['prefilled']} tokens, loaded "
                  f"{r['host_tokens']} (L2) + {r['remote_tokens']} (L3)", flush=True)
    base = results.get("off")
    print(f"\n{'tiers':<10}{'out tok/s':>10}{'vs off':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'vs off':>8}"
          f"{'prefilled':>11}{'from L2':>9}{'from L3':>9}")
    for kind, r in results.items():
        ratio = f"{r['tok_s'] / base['tok_s']:>7.2f}x" if base else f"{'-':>8}"
        tratio = f"{r['ttft_cached_p50'] / base['ttft_cached_p50']:>7.2f}x" if base else f"{'-':>8}"
        print(f"{KINDS[kind]:<10}{r['tok_s']:>10.1f}{ratio}{r['ttft_cached_p50'] * 1e3:>8.0f}ms"
              f"{r['ttft_cached_p99'] * 1e3:>8.0f}ms{tratio}{r['prefilled']:>11}{r['host_tokens']:>9}"
              f"{r['remote_tokens']:>9}")
    return 0
