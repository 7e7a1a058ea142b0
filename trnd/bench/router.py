"""`trnd bench router`: session affinity vs random routing through `trnd serve --prefill 1 --decode 2`.

A multi-turn replay (every session resends its growing history each turn, with its session_id) runs
against the same local xPyD deployment twice, once with the router's affinity policy and once with
`random` (each request to a target hashed from its sequence number: what a session-unaware balancer
does; plain round-robin would keep each session on one server whenever the sessions per round divide
evenly), in one command. Each decode server's pool is sized to hold half the sessions' histories
but not all of them, so a router that keeps a session on one decode server finds its history there,
and one that alternates does not. Reported: prompt tokens the client sent, tokens served from a
decode server's cache (usage.cached_tokens), tokens the prefill server computed, cached-turn TTFT.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from trnd.bench import cpu_line
from trnd.bench.disagg import _stop
from trnd.procs import free_port, wait_ready


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="model dir or preset (default small)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4, help="turns in flight at once")
    p.add_argument("--first", type=int, default=128, help="tokens of a session's first prompt")
    p.add_argument("--growth", type=int, default=256, help="new tokens a turn")
    p.add_argument("--gen", type=int, default=16, help="tokens generated a turn")
    p.add_argument("--kv-memory-gb", type=float, default=0.23,
                   help="pool per role: holds half the sessions' final histories, not all (small model, bf16)")
    p.add_argument("--policies", default="affinity,random")


def start(model: str, policy: str, args, tmp: Path) -> tuple[subprocess.Popen, int, int]:
    port, admin = free_port(), free_port()
    cfg = tmp / f"{policy}.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {
        "model": model, "port": port, "num_prefill": 1, "num_decode": 2, "router_policy": policy,
        "prefill_admin_port": admin, "kv_memory_gb": args.kv_memory_gb, "served_model_name": "m",
        "log_level": "warning"}.items()))
    log = open(tmp / f"{policy}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--config", str(cfg)], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_ready(port, [proc], timeout=600)
        deadline = time.monotonic() + 300
        while not all(t["healthy"] for t in httpx.get(f"http://127.0.0.1:{port}/admin/state").json()["peers"]):
            if time.monotonic() > deadline:
                raise RuntimeError("the decode servers never became healthy behind the router")
            time.sleep(0.5)
    except BaseException:  # never leave a deployment running behind a failed start
        _stop([proc])
        raise
    return proc, port, admin


async def one_turn(client: httpx.AsyncClient, port: int, session: str, prompt: list[int], gen: int) -> dict:
    t, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=900, json={
            "model": "m", "prompt": prompt, "max_tokens": gen, "stream": True, "ignore_eos": True,
            "temperature": 0, "session_id": session, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"turn failed: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - t
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": first, "prompt": (usage or {}).get("prompt_tokens", len(prompt)),
            "cached": details.get("cached_tokens") or 0}


async def replay(port: int, sessions, growth, answers, args) -> dict:
    """Round after round (turn t of every session, then turn t+1), `concurrency` at a time."""
    hist = [list(s) for s in sessions]
    rows: list[tuple[int, dict]] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency + 4)) as client:
        for t in range(args.turns):
            async def turn(i: int, t=t) -> None:
                async with sem:
                    prompt = hist[i] + growth[i][t]
                    rows.append((t, await one_turn(client, port, f"session-{i}", prompt, args.gen)))
                    hist[i] = prompt + answers[i]
            await asyncio.gather(*(turn(i) for i in range(len(sessions))))
    cached_ttft = [r["ttft"] for t, r in rows if t > 0]
    return {"prompt_tokens": sum(r["prompt"] for _, r in rows), "cached_tokens": sum(r["cached"] for _, r in rows),
            "ttft_cached_p50": statistics.median(cached_ttft), "ttft_first_p50":
            statistics.median([r["ttft"] for t, r in rows if t == 0])}


def main(args) -> int:
    import torch

    from trnd.model.maker import resolve_model

    from trnd.model.config import ModelConfig

    model = str(resolve_model(args.model))
    g = torch.Generator().manual_seed(0)
    vocab = min(15000, ModelConfig.from_dir(model).vocab_size - 1)
    sessions = [torch.randint(10, vocab, (args.first,), generator=g).tolist() for _ in range(args.sessions)]
    growth = [[torch.randint(10, vocab, (args.growth,), generator=g).tolist() for _ in range(args.turns)]
              for _ in range(args.sessions)]
    answers = [torch.randint(10, vocab, (args.gen,), generator=g).tolist() for _ in range(args.sessions)]
    final = args.first + args.turns * args.growth + (args.turns - 1) * args.gen
    print(f"trnd bench router: model {model}, trnd serve --prefill 1 --decode 2, {args.sessions} sessions x "
          f"{args.turns} turns ({args.concurrency} at a time), +{args.growth} tokens a turn, final history {final} "
          f"tokens, working set {args.sessions * final} tokens; pool {args.kv_memory_gb} GiB per role", flush=True)
    print(cpu_line(), flush=True)
    results = {}
    for policy in args.policies.split(","):
        with tempfile.TemporaryDirectory(prefix="trnd-bench-router-") as tmp:
            proc, port, admin = start(model, policy, args, Path(tmp))
            try:
                t0 = time.perf_counter()
                res = asyncio.run(replay(port, sessions, growth, answers, args))
                res["wall_s"] = time.perf_counter() - t0
                res["prefill_computed"] = httpx.get(f"http://127.0.0.1:{admin}/admin/state").json()["stats"][
                    "prefill_tokens"]
                res["routed"] = httpx.get(f"http://127.0.0.1:{port}/admin/state").json()["routing"]
            finally:
                _stop([proc])
        results[policy] = res
        print(f"  {policy}: {res}", flush=True)
    names = list(results)
    print(f"\n{'metric':<34}" + "".join(f"{n:>14}" for n in names) + (f"{'ratio':>9}" if len(names) == 2 else ""))
    for key, label in (("prompt_tokens", "prompt tokens sent"), ("cached_tokens", "served from decode's cache"),
                       ("prefill_computed", "computed by the prefill server"),
                       ("ttft_cached_p50", "cached-turn TTFT p50 (s)"), ("ttft_first_p50", "first-turn TTFT p50 (s)"),
                       ("wall_s", "replay wall time (s)")):
        vals = [results[n][key] for n in names]
        ratio = f"{vals[0] / vals[1]:>8.2f}x" if len(vals) == 2 and vals[1] else ""
        print(f"{label:<34}" + "".join(f"{v:>14.3f}" if isinstance(v, float) else f"{v:>14}" for v in vals) + ratio)
    return 0
