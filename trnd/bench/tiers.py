"""`trnd bench tiers`: a multi-turn agentic replay against a local prefill + decode deployment, with
the tiers off (device prefix cache only), host L2, and host L2 + a remote L3 store, in one run.

Every session resends its whole, growing history each turn; all sessions take their turn together.
The device pools are sized below the working set, so without lower tiers the history is recomputed.
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

from trnd.bench.disagg import _free_port, _stop, _wait


def start(kind: str, model: str, args, tmp: Path) -> tuple[list, int, dict]:
    exe = [sys.executable, "-m", "trnd"]
    secret = tmp / "secret"
    if not secret.exists():
        secret.write_text(secrets.token_hex(16))
    log = open(tmp / f"{kind}.log", "w")
    procs, extra = [], []
    if kind == "l2+l3":
        cp, ap = _free_port(), _free_port()
        procs.append(subprocess.Popen([*exe, "store", "--secret-file", str(secret), "--control-port", str(cp),
                                       "--admin-port", str(ap), "--memory-gb", str(args.store_gb)],
                                      stdout=log, stderr=subprocess.STDOUT))
        _wait(ap, procs)
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
    _wait(port, procs)
    return procs, port, {"prefill_admin": admin}


async def one_turn(client: httpx.AsyncClient, port: int, prompt: list[int], gen: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    first = None
    tokens: list[int] = []
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=900,
                             json={"model": "m", "prompt": prompt, "max_tokens": gen, "stream": True,
                                   "ignore_eos": True, "temperature": 0, "logprobs": 0,
                                   "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first is None and '"text"' in line:
                first = time.perf_counter() - t
    return first or (time.perf_counter() - t), tokens


async def replay(port: int, sessions: list[list[int]], turns: int, growth: list[list[list[int]]], gen: int,
                 answers: list[list[int]]) -> dict:
    """Turn t of every session at once; histories grow by the new message and a fixed answer."""
    ttft_first, ttft_cached = [], []
    out_tokens = 0
    t0 = time.perf_counter()
    async with httpx.AsyncClient() as client:
        hist = [list(s) for s in sessions]
        for t in range(turns):
            prompts = [h + growth[i][t] for i, h in enumerate(hist)]
            res = await asyncio.gather(*(one_turn(client, port, p, gen) for p in prompts))
            (ttft_first if t == 0 else ttft_cached).extend(r[0] for r in res)
            out_tokens += gen * len(prompts)
            # the client keeps a deterministic transcript: the same answer tokens for every config
            hist = [p + answers[i] for i, p in enumerate(prompts)]
    wall = time.perf_counter() - t0
    return {"tok_s": out_tokens / wall, "wall_s": wall,
            "ttft_cached_p50": statistics.median(ttft_cached) if ttft_cached else 0.0,
            "ttft_cached_p99": sorted(ttft_cached)[int(0.99 * (len(ttft_cached) - 1))] if ttft_cached else 0.0,
            "ttft_first_p50": statistics.median(ttft_first)}


def main(args) -> int:
    import torch

    from trnd.roles.serve import resolve_model

    model = str(resolve_model(args.model))
    g = torch.Generator().manual_seed(0)
    vocab = 15000
    sessions = [torch.randint(10, vocab, (args.first,), generator=g).tolist() for _ in range(args.sessions)]
    growth = [[torch.randint(10, vocab, (args.growth,), generator=g).tolist() for _ in range(args.turns)]
              for _ in range(args.sessions)]
    answers = [torch.randint(10, vocab, (args.gen,), generator=g).tolist() for _ in range(args.sessions)]
    final = args.first + args.turns * (args.growth + args.gen)
    print(f"trnd bench tiers: model {model}, {args.sessions} sessions x {args.turns} turns, first prompt "
          f"{args.first}, +{args.growth} tokens a turn, {args.gen} generated; final history {final} tokens; "
          f"working set {args.sessions * final} tokens; device pool {args.kv_memory_gb} GiB per role", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("off", "l2", "l2+l3"):
            procs, port, ports = start(kind, model, args, Path(tmp))
            try:
                results[kind] = asyncio.run(replay(port, sessions, args.turns, growth, args.gen, answers))
                st = httpx.get(f"http://127.0.0.1:{ports['prefill_admin']}/admin/state", timeout=10).json()
                results[kind]["prefilled"] = st["stats"]["prefill_tokens"]
                results[kind]["loaded"] = st["stats"]["loaded_tokens"]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                _stop(procs)
            r = results[kind]
            print(f"  {kind:<6} {r['tok_s']:.1f} tok/s, cached-turn TTFT p50 {r['ttft_cached_p50'] * 1e3:.0f} ms, "
                  f"prefilled {r['prefilled']} tokens, loaded {r['loaded']}", flush=True)
    base = results["off"]
    print(f"\n{'tiers':<8}{'out tok/s':>10}{'ratio':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'vs off':>8}"
          f"{'prefilled':>11}{'loaded':>9}")
    for kind, r in results.items():
        print(f"{kind:<8}{r['tok_s']:>10.1f}{r['tok_s'] / base['tok_s']:>7.2f}x"
              f"{r['ttft_cached_p50'] * 1e3:>8.0f}ms{r['ttft_cached_p99'] * 1e3:>8.0f}ms"
              f"{r['ttft_cached_p50'] / base['ttft_cached_p50']:>7.2f}x{r['prefilled']:>11}{r['loaded']:>9}")
    return 0
