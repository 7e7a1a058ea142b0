"""`trnd bench million`: one request at 1,048,576 tokens of context through the `1m` point, end to end.

    trnd bench million [--context 1048576] [--decode-tokens 16]

A local `trnd serve --prefill 1 --decode 1 --point 1m` with L2 on the decode server serves, over HTTP:
  1. the prompt (context - decode-tokens tokens): prefilled in the point's 8K chunks on the prefill server,
     handed over (NIXL WRITE into the decode server's pool, pipelined), decoded there at 1M context;
  2. /admin/evict on the decode server: its cached pages go to L2 (write-back);
  3. the same prompt again: its pages are loaded back from L2, not prefilled, and the tokens must be the same.
Each phase's time comes from the client and the roles' request traces (/admin/requests), each process's
memory from /proc (resident now and peak), the pages from /admin/state's integrity check after each phase.

The model is the `tiny` preset (Llama layout, hidden 64, 4 heads, 2 KV heads, head_dim 16 or --head-dim) with one
decoder layer and llama3 RoPE scaling to 1,048,576 positions (factor 128 over 8192), fp32. Why one layer: the engine
runs the last layer on the sampled rows only (the other rows feed nothing but the KV cache), so with one layer
a prefill chunk attends for its last row only, and the prefill is the linears, RoPE and the KV writes; a
second layer would add full causal attention over 1M tokens, ~3.5e13 FLOPs per head on 2 cores (hours:
docs/RESULTS.md says what it measured). Every decode step attends over the whole context.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ORIGINAL = 8192


def add_arguments(p) -> None:
    p.add_argument("--context", type=int, default=1_048_576, help="prompt + decoded tokens")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=16,
                   help="the model's head_dim (default 16, the tiny preset's; 64 is what real models have, "
                        "4x the KV: 1 GiB for 1M tokens, pools and L2 sized for it)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out-dir", help="logs and results (default: a new temp dir)")


def million_model(max_context: int = 1_048_576, head_dim: int = 16) -> Path:
    from trnd.model.maker import cache_dir, make_model

    factor = max(1, -(-max_context // ORIGINAL))
    out = cache_dir() / f"tiny1-llama-rope{factor * ORIGINAL}" if head_dim == 16 else \
        cache_dir() / f"tiny1-llama-hd{head_dim}-rope{factor * ORIGINAL}"
    if not (out / "config.json").is_file():
        scaling = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": ORIGINAL}
        make_model(out, preset="tiny", arch="llama", seed=0, dtype="float32",
                   overrides={"rope_scaling": scaling, "num_hidden_layers": 1, "head_dim": head_dim})
    return out


def memory(pids: dict[str, int]) -> dict[str, dict]:
    out = {}
    for name, pid in pids.items():
        try:
            st = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
        except OSError:
            continue
        out[name] = {"rss_mib": int(st["VmRSS"].split()[0]) // 1024, "peak_mib": int(st["VmHWM"].split()[0]) // 1024}
    return out


def role_pids(root: int) -> dict[str, int]:
    """The deployment's processes by role (its children's command lines name them)."""
    out, todo = {"serve": root}, [root]
    while todo:
        pid = todo.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                kids = [int(c) for c in (task / "children").read_text().split()]
                todo += kids
                for k in kids:
                    cmd = Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")
                    for role in (b"prefill", b"decode", b"store"):
                        if role in cmd[:6]:  # python [-P] -m trnd ROLE
                            out[role.decode()] = k
        except OSError:
            continue
    return out


def stream(client: httpx.Client, url: str, prompt: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    stamps, tokens, rid = [], [], None
    with client.stream("POST", url + "/v1/completions", timeout=3600, json={
            "model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            for c in chunk.get("choices") or []:
                lp = c.get("logprobs") or {}
                tokens += lp.get("tokens") or []
                stamps.append(time.perf_counter() - t0)
    if not stamps:
        raise SystemExit("the request streamed no token (see the servers' log)")
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"id": rid, "ttft_s": stamps[0], "e2e_s": stamps[-1], "tokens": tokens,
            "decode_step_ms_p50": sorted(steps)[len(steps) // 2] * 1e3 if steps else None}


def main(args) -> int:
    from trnd.bench import cpu_line
    from trnd.procs import free_port, wait_ready

    print(cpu_line(), flush=True)
    model = million_model(head_dim=args.head_dim)
    kv_gb = round(0.3 * args.head_dim / 16, 2)  # the point asks one 1M sequence and some, fp32 (256 MiB at 16)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="trnd-bench-million-"))
    out.mkdir(parents=True, exist_ok=True)
    port, admin = free_port(), free_port()
    cfg = {"model": str(model), "port": port, "num_prefill": 1, "num_decode": 1, "point": "1m", "dtype": "float32",
           "kv_memory_gb": kv_gb, "host_cache_gb": kv_gb, "max_body_bytes": 32 * 2**20, "prefill_admin_port": admin,
           "served_model_name": "m", "log_level": "info"}
    if args.threads:
        cfg["threads"] = args.threads
    (out / "serve.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items()))
    print(f"model {model.name}; trnd serve --config {out / 'serve.toml'}: {cfg}", flush=True)
    log = open(out / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "trnd", "serve", "--config", str(out / "serve.toml")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = {}
    try:
        wait_ready(port, [proc], timeout=600)
        pids = role_pids(proc.pid)
        url, purl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
        rng = random.Random(0)
        prompt = [rng.randrange(10, 1000) for _ in range(args.context - args.decode_tokens)]
        print(f"ready; roles {pids}; memory {memory(pids)}", flush=True)
        with httpx.Client() as client:
            rows["first"] = first = stream(client, url, prompt, args.decode_tokens)
            rows["first"]["memory"] = memory(pids)
            rows["first"]["traces"] = traces(client, url, purl, first["id"])
            print(f"1. prefill + handoff + decode: {summary(first)}", *phases(first), sep="\n   ", flush=True)
            t = time.perf_counter()
            ev = client.post(url + "/admin/evict", timeout=600).json()
            rows["evict"] = {"s": time.perf_counter() - t, **ev, "memory": memory(pids)}
            print(f"2. evict to L2: {rows['evict']}", flush=True)
            rows["again"] = again = stream(client, url, prompt, args.decode_tokens)
            rows["again"]["memory"] = memory(pids)
            rows["again"]["traces"] = traces(client, url, purl, again["id"])
            print(f"3. again, from L2: {summary(again)}", *phases(again), sep="\n   ", flush=True)
            if again["tokens"] != first["tokens"]:
                raise SystemExit("the reloaded request's tokens differ from the first's")
            rows["state"] = {"decode": integrity_after(client, url, time.time()),
                             "prefill": integrity_after(client, purl, time.time())}
            print(f"pages: {rows['state']}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        if "first" in rows and rows["first"]["decode_step_ms_p50"]:
            rows["floor"] = floor(model, args.context, rows["first"]["decode_step_ms_p50"])
            print(f"decode step at {args.context}: {rows['floor']}", flush=True)
        (out / "million.json").write_text(json.dumps(rows, indent=1, default=str))
        print(f"results in {out}", flush=True)
    return 0


def floor(model: Path, context: int, step_ms: float) -> dict:
    """The decode step against its floor: the bytes one step reads at least (every weight once, the K and V of
    the whole context) over the measured read bandwidth (bench/engine.py), measured with the servers idle."""
    from trnd.bench.engine import read_bandwidth_gbs, weight_bytes
    from trnd.model.config import ModelConfig

    mc = ModelConfig.from_dir(model, None)
    kv = context * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4  # fp32 pages
    w = weight_bytes(str(model), "float32")
    gbs = read_bandwidth_gbs()
    floor_ms = (w + kv) / gbs / 1e6
    return {"weights_mib": round(w / 2**20, 2), "kv_mib": round(kv / 2**20, 1), "read_gbs": round(gbs, 1),
            "floor_ms": round(floor_ms, 2), "step_ms": round(step_ms, 2), "ratio": round(step_ms / floor_ms, 2)}


def integrity_after(client: httpx.Client, base: str, since: float, timeout: float = 30.0) -> dict | None:
    """The role's page check (engine/state.py: run when idle, at most every 10 s) once it ran after `since`."""
    deadline = time.monotonic() + timeout
    while True:
        got = client.get(base + "/admin/state").json().get("integrity") or {}
        if (got.get("at") or 0) > since or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def traces(client: httpx.Client, url: str, purl: str, rid: str | None) -> dict:
    out = {}
    for name, base in (("decode", url), ("prefill", purl)):
        r = client.get(f"{base}/admin/requests/{rid}")
        out[name] = r.json() if r.status_code == 200 else None
    return out


def phases(r: dict) -> list[str]:
    """Each role's request timeline relative to the decode server's arrival, the per-write lines folded."""
    out, t0 = [], None
    for role in ("decode", "prefill"):
        got = (r.get("traces") or {}).get(role) or {}
        for tr in got.get("traces") or []:
            t0 = t0 if t0 is not None else tr["phases"][0]["t"]
            writes = [p for p in tr["phases"] if p["what"].startswith("KV write")]
            for p in tr["phases"]:
                if p in writes[1:-1]:
                    continue
                out.append(f"{role} +{p['t'] - t0:.3f} s: {p['what']}")
    return out


def summary(r: dict) -> str:
    step = f"{r['decode_step_ms_p50']:.1f} ms" if r["decode_step_ms_p50"] is not None else "-"
    return (f"TTFT {r['ttft_s']:.1f} s, decode step p50 {step}, {len(r['tokens'])} tokens, "
            f"e2e {r['e2e_s']:.1f} s, memory {r['memory']}")
