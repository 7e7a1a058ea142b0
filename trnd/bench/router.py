"""`trnd bench router`: session affinity vs random routing through `trnd serve --prefill 1 --decode 2`.

A multi-turn replay (every session resends its growing history each turn, with its session_id) runs
against the same local xPyD deployment twice, once with the router's affinity policy and once with
`random` (each request to a target hashed from its sequence number: what a session-unaware balancer
does; plain round-robin would keep each session on one server whenever the sessions per round divide
evenly), in one command. Each decode server's pool is sized to hold half the sessions' histories
but not all of them, so a router that keeps a session on one decode server finds its history there,
and one that alternates does not. Reported: prompt tokens the client sent, tokens served from a
decode server's cache (usage.cached_tokens), tokens the prefill server computed, cached-turn TTFT.

With `--prefill 2` the prefill leg is what is compared: policy `events` is the affinity router on its targets'
KV events, which also sends each prompt's prefill to the prefill server holding its prefix (the x-trnd-prefill
hint), against `affinity`, where decode picks the least-loaded prefill server; reported beside the above: the
tokens the prefill servers computed and found in their own caches, and the handoffs that followed the hint.

`--events` compares routers instead (main_events): two aggregated servers publishing KV events behind two
replicas of each router kind.
"""

from __future__ import annotations

import asyncio
import hashlib
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
    p.add_argument("--policies", default="affinity,random",
                   help="router policies, in order: affinity, random, events (affinity on the targets' KV events, "
                        "the prefill leg to the prefill server holding the prefix)")
    p.add_argument("--prefill", type=int, default=1, help="prefill servers (2: the prefill leg's routing shows)")
    p.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="decode prefills prompts of at most this many uncached tokens itself (default: trnd serve's "
                        "auto, 1000 where the roles share the cores); 0 sends every prompt to a prefill server")
    p.add_argument("--events", action="store_true",
                   help="routing on KV events: two aggregated servers publishing events behind two router replicas "
                        "(each client request to a replica hashed from its session and turn, no session ids), trnd router on events vs its "
                        "text guess vs vllm-router's kv_aware (--event-routers)")
    p.add_argument("--event-routers", default="events,guess",
                   help="router kinds, in order: events, guess, random (trnd router --policy random: the "
                        "cache-blind baseline), vllm-router (0.1.17's kv_aware on trnd's events; the replay sends token "
                        "ids, which it routes on: text prompts it decided 'missing_tokens', by load)")


def start(model: str, policy: str, args, tmp: Path) -> tuple[subprocess.Popen, int, list[int]]:
    """`trnd serve --prefill N --decode 2` with `policy` (events: affinity, every role publishing KV events and
    the router reading them). Returns the process, the router's port and the prefill servers' admin ports."""
    port, admins = free_port(), [free_port() for _ in range(args.prefill)]
    cfg = tmp / f"{policy}.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {
        "model": model, "port": port, "num_prefill": args.prefill, "num_decode": 2,
        "router_policy": "affinity" if policy == "events" else policy, "prefill_admin_port": admins[0],
        "kv_memory_gb": args.kv_memory_gb, "served_model_name": "m", "log_level": "warning",
        **({} if args.local_prefill_tokens is None else {"local_prefill_tokens": args.local_prefill_tokens})}.items())
        + ("kv_events = {enable_kv_cache_events = true}\n" if policy == "events" else ""))
    admins = [admins[0] + i for i in range(args.prefill)]  # trnd serve numbers them up from the first
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
    return proc, port, admins


async def one_turn(client: httpx.AsyncClient, port: int, session: str | None, prompt: list[int], gen: int) -> dict:
    t, first, usage = time.perf_counter(), None, None
    body = {"model": "m", "prompt": prompt, "max_tokens": gen, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if session is not None:
        body["session_id"] = session
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=900, json=body) as r:
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


def replica(session: int, turn: int, n: int) -> int:
    """The router replica a load balancer sends this turn of this session to: a hash, the same on every run."""
    return int.from_bytes(hashlib.blake2b(f"{session}:{turn}".encode(), digest_size=8).digest(), "big") % n


async def replay(port: int | list[int], sessions, growth, answers, args, with_session: bool = True) -> dict:
    """Round after round (turn t of every session, then turn t+1), `concurrency` at a time; with several
    ports (router replicas) each request goes to one picked by a hash of (session, turn), as a load balancer in
    front of router pods spreads them: a replica sees some of a session's turns, not all (taking the replicas in
    turn would keep every session on one replica whenever the sessions per round divide evenly)."""
    ports = port if isinstance(port, list) else [port]
    hist = [list(s) for s in sessions]
    rows: list[tuple[int, dict]] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=args.concurrency + 4)) as client:
        for t in range(args.turns):
            async def turn(i: int, t=t) -> None:
                async with sem:
                    prompt = hist[i] + growth[i][t]
                    p = ports[replica(i, t, len(ports))]
                    rows.append((t, await one_turn(client, p, f"session-{i}" if with_session else None, prompt,
                                                   args.gen)))
                    hist[i] = prompt + answers[i]
            await asyncio.gather(*(turn(i) for i in range(len(sessions))))
    cached_ttft = [r["ttft"] for t, r in rows if t > 0]
    return {"prompt_tokens": sum(r["prompt"] for _, r in rows), "cached_tokens": sum(r["cached"] for _, r in rows),
            "ttft_cached_p50": statistics.median(cached_ttft), "ttft_first_p50":
            statistics.median([r["ttft"] for t, r in rows if t == 0])}


def workload(model: str, args):
    import torch

    from trnd.model.config import ModelConfig

    g = torch.Generator().manual_seed(0)
    vocab = min(15000, ModelConfig.from_dir(model).vocab_size - 1)
    sessions = [torch.randint(10, vocab, (args.first,), generator=g).tolist() for _ in range(args.sessions)]
    growth = [[torch.randint(10, vocab, (args.growth,), generator=g).tolist() for _ in range(args.turns)]
              for _ in range(args.sessions)]
    answers = [torch.randint(10, vocab, (args.gen,), generator=g).tolist() for _ in range(args.sessions)]
    return sessions, growth, answers


def _router(kind: str, model: str, servers: list[int], tmp: Path, n: int) -> tuple[subprocess.Popen, int, int | None]:
    """One router replica: trnd router on events, trnd router guessing from its own texts, trnd router at random,
    or vllm-router's kv_aware policy fed by the servers' events. Returns the process, its port and (vllm-router)
    its Prometheus port."""
    import os
    import shutil

    port, metrics = free_port(), None
    log = open(tmp / f"{kind}-{n}.log", "w")
    if kind == "vllm-router":
        metrics = free_port()
        exe = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware", "--worker-urls",
               *[f"http://127.0.0.1:{p}" for p in servers], "--kv-event-block-size", "16", "--kv-event-model", model,
               "--health-check-endpoint", "/ready", "--prometheus-port", str(metrics)]
        for p in servers:
            kv = httpx.get(f"http://127.0.0.1:{p}/admin/state").json()["kv_events"]
            cmd += ["--kv-event-source", f"http://127.0.0.1:{p}={kv['endpoint']}"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ,
                                                                                   VLLM_ROUTER_TOKENIZER=model))
        path = "/health"
    else:
        cmd = [sys.executable, "-m", "trnd", "router", "--port", str(port), "--model", model, "--log-level", "warning",
               *sum((["--target", f"127.0.0.1:{p}"] for p in servers), [])] + \
            {"events": ["--kv-events"], "random": ["--policy", "random"]}.get(kind, [])
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        path = "/ready"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            _stop([proc])
            raise RuntimeError(f"router {kind} did not start: {(tmp / f'{kind}-{n}.log').read_text()[-2000:]}")
        time.sleep(0.3)
    time.sleep(1.0)  # its event subscriptions connect and replay
    return proc, port, metrics


def _kv_routing_inputs(metrics: int | None) -> dict[str, float]:
    """vllm-router's count of its KV-aware decisions' inputs by transport and result (why it routed as it did)."""
    if metrics is None:
        return {}
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    return {line.split(" ")[0].removeprefix("vllm_router_kv_routing_inputs_total"): float(line.split(" ")[-1])
            for line in text.splitlines() if line.startswith("vllm_router_kv_routing_inputs_total")}


def main_events(args, model: str) -> int:
    """Two aggregated servers publishing KV events, each router kind as two replicas (each request to a replica
    hashed from its session and turn, as a load balancer spreads them over gateway pods): a router that guesses
    knows only what it routed, about half the traffic; one that reads the events knows both servers' real caches,
    evictions included."""
    sessions, growth, answers = workload(model, args)
    events = json.dumps({"enable_kv_cache_events": True})
    print(f"trnd bench router --events: model {model}, 2 x trnd serve --aggregated (kv events on, pool "
          f"{args.kv_memory_gb} GiB each) behind 2 router replicas, {args.sessions} sessions x {args.turns} turns, "
          f"no session ids ({args.concurrency} at a time)", flush=True)
    print(cpu_line(), flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="trnd-bench-router-events-") as tmp:
        servers, ports = [], []
        try:
            for i in range(2):
                p = free_port()
                log = open(Path(tmp) / f"server{i}.log", "w")
                servers.append(subprocess.Popen(
                    [sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", model, "--port", str(p),
                     "--kv-memory-gb", str(args.kv_memory_gb), "--served-model-name", "m", "--log-level", "warning",
                     "--kv-events-config", events], stdout=log, stderr=subprocess.STDOUT))
                ports.append(p)
            for p, proc in zip(ports, servers):
                wait_ready(p, [proc], timeout=600)
            final = args.first + args.turns * args.growth + (args.turns - 1) * args.gen
            pool = httpx.get(f"http://127.0.0.1:{ports[0]}/admin/state").json()["pages"]
            print(f"pool {pool['token_capacity']} tokens a server ({pool['kv_dtype']}); working set "
                  f"{args.sessions * final} tokens (final histories)", flush=True)
            for kind in args.event_routers.split(","):
                for p in ports:  # every kind starts from cold caches
                    httpx.post(f"http://127.0.0.1:{p}/admin/evict", timeout=60)
                routers = [_router(kind, model, ports, Path(tmp), n) for n in range(2)]
                try:
                    t0 = time.perf_counter()
                    res = asyncio.run(replay([rp for _, rp, _ in routers], sessions, growth, answers, args,
                                             with_session=False))
                    res["wall_s"] = time.perf_counter() - t0
                    res["computed"] = res["prompt_tokens"] - res["cached_tokens"]
                    inputs = [_kv_routing_inputs(m) for _, _, m in routers]
                    if any(inputs):
                        res["kv_routing_inputs"] = {k: sum(i.get(k, 0) for i in inputs) for k in set().union(*inputs)}
                finally:
                    _stop([proc for proc, _, _ in routers])
                results[kind] = res
                print(f"  {kind}: {res}", flush=True)
        finally:
            _stop(servers)
    names = list(results)
    print(f"\n{'metric':<34}" + "".join(f"{n:>14}" for n in names))
    for key, label in (("prompt_tokens", "prompt tokens sent"), ("cached_tokens", "served from a server's cache"),
                       ("computed", "prompt tokens computed"), ("ttft_cached_p50", "later-turn TTFT p50 (s)"),
                       ("wall_s", "replay wall time (s)")):
        print(f"{label:<34}" + "".join(f"{results[n][key]:>14.3f}" if isinstance(results[n][key], float)
                                       else f"{results[n][key]:>14}" for n in names))
    return 0


def main(args) -> int:
    from trnd.model.maker import resolve_model

    model = str(resolve_model(args.model))
    if args.events:
        return main_events(args, model)
    sessions, growth, answers = workload(model, args)
    final = args.first + args.turns * args.growth + (args.turns - 1) * args.gen
    print(f"trnd bench router: model {model}, trnd serve --prefill {args.prefill} --decode 2, {args.sessions} sessions "
          f"x {args.turns} turns ({args.concurrency} at a time), +{args.growth} tokens a turn, final history {final} "
          f"tokens, working set {args.sessions * final} tokens; pool {args.kv_memory_gb} GiB per role", flush=True)
    print(cpu_line(), flush=True)
    results = {}
    for policy in args.policies.split(","):
        with tempfile.TemporaryDirectory(prefix="trnd-bench-router-") as tmp:
            proc, port, admins = start(model, policy, args, Path(tmp))
            try:
                t0 = time.perf_counter()
                res = asyncio.run(replay(port, sessions, growth, answers, args))
                res["wall_s"] = time.perf_counter() - t0
                pre = [httpx.get(f"http://127.0.0.1:{a}/admin/state").json() for a in admins]
                res["prefill_computed"] = sum(st["stats"]["prefill_tokens"] for st in pre)
                res["prefill_cached"] = sum(st["stats"]["cached_tokens"] for st in pre)
                res["pool_tokens"] = pre[0]["pages"]["token_capacity"]
                front = httpx.get(f"http://127.0.0.1:{port}/admin/state").json()
                res["routed"] = front["routing"]
                decode = [httpx.get(f"http://{t['addr']}/admin/state").json() for t in front["peers"]]
                moves = [d.get("transfers") or {} for d in decode]
                res["prefill_by_prefix"] = sum(m.get("prefill_by_prefix") or 0 for m in moves)
                res["decode_local"] = sum((m.get("local_prefills") or 0) + (m.get("local_for_link") or 0) +
                                          (m.get("local_fallbacks") or 0) for m in moves)
                # decode counts its own prefills and, for each handoff, the tokens its peer computed: the deployment's
                res["computed"] = sum(d["stats"]["prefill_tokens"] for d in decode)
                res["decode_computed"] = res["computed"] - res["prefill_computed"]
            finally:
                _stop([proc])
        results[policy] = res
        print(f"  {policy}: {res}", flush=True)
    names = list(results)
    print(f"\n{'metric':<34}" + "".join(f"{n:>14}" for n in names) + (f"{'ratio':>9}" if len(names) == 2 else ""))
    for key, label in (("prompt_tokens", "prompt tokens sent"), ("cached_tokens", "served from decode's cache"),
                       ("prefill_computed", "computed by the prefill servers"),
                       ("prefill_cached", "found in the prefill servers' caches"),
                       ("decode_computed", "computed by the decode servers"),
                       ("computed", "prompt tokens computed, all roles"),
                       ("prefill_by_prefix", "prefill legs routed by prefix"),
                       ("decode_local", "prompts prefilled on decode"),
                       ("ttft_cached_p50", "cached-turn TTFT p50 (s)"), ("ttft_first_p50", "first-turn TTFT p50 (s)"),
                       ("wall_s", "replay wall time (s)")):
        vals = [results[n][key] for n in names]
        ratio = f"{vals[0] / vals[1]:>8.2f}x" if len(vals) == 2 and vals[1] else ""
        print(f"{label:<34}" + "".join(f"{v:>14.3f}" if isinstance(v, float) else f"{v:>14}" for v in vals) + ratio)
    return 0
