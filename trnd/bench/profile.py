"""Where a server's time goes under load: py-spy samples of the process that runs the decode steps,
binned into model forward / attention / scheduler / HTTP."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path



from trnd.bench.servers import Ctx, Server, bench_cmd, client_env, http_get, shown


# (category, test on (function, file)); the first that matches, walking from the sampled leaf to the root.
WAITS = ("Condition.wait", "Event.wait", "Runner.run", "select", "poll", "sleep", "_worker", "Thread.join")


CATEGORIES = [
    ("waiting: engine idle-poll, event loop in uvloop's C code", lambda fn, f: False),  # leaf in WAITS, below
    ("attention: page gather", lambda fn, f: f.endswith("kernels/attention.py") and fn == "_gather"),
    ("attention: KV write", lambda fn, f: f.endswith("kernels/attention.py") and fn == "write_kv"),
    ("attention: SDPA + mask", lambda fn, f: f.endswith("kernels/attention.py")),
    ("attention: compiled kernels (KV write, paged attention)", lambda fn, f: f.endswith("kernels/cpu/__init__.py")),
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
