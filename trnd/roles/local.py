"""`trnd serve` (default): a local disaggregated deployment on one machine. Starts one `trnd prefill`
and one `trnd decode` process on loopback (the API on the serve port), supervises them — a prefill
that dies is restarted and re-handshaked; the decode process is the deployment's lifetime — and
forwards SIGTERM/SIGINT/SIGHUP. `trnd serve --aggregated` runs everything in one process instead."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from trnd.config import ServeConfig
from trnd.procs import EX_CONFIG, die_with_parent, free_port, is_ready

log = logging.getLogger("trnd.local")


def _write(path: Path, data: dict) -> Path:
    """Flat TOML: JSON's strings, numbers, booleans and arrays are valid TOML values."""
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items() if v is not None))
    return path


def role_configs(cfg: ServeConfig, model: str, workdir: Path) -> tuple[Path, Path, int, int]:
    """prefill.toml and decode.toml for this deployment; returns (prefill, decode, control, admin port)."""
    if cfg.secret_file or cfg.secret:  # shared with stores the operator runs: use theirs
        secret = workdir / "control_secret"
        secret.write_bytes(cfg.resolved_secret_optional())
    else:
        secret = workdir / "control_secret"
        secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    control, admin = cfg.prefill_control_port or free_port(), cfg.prefill_admin_port or free_port()
    role = {"model": model, "point": cfg.point, "dtype": cfg.dtype, "backend": cfg.backend, "tp": cfg.tp,
            "kv_memory_gb": cfg.kv_memory_gb, "prefix_cache": cfg.prefix_cache, "threads": cfg.threads,
            "secret_file": str(secret), "log_level": cfg.log_level, "host_cache_gb": cfg.host_cache_gb,
            "host_policy": cfg.host_policy, "node_host_memory_gb": cfg.node_host_memory_gb,
            "store": list(cfg.store), "store_on_finish": cfg.store_on_finish, "store_deadline_s": cfg.store_deadline_s}
    prefill = _write(workdir / "prefill.toml", {**role, "host": "127.0.0.1", "control_port": control,
                                                 "admin_port": admin})
    dec = msgspec.structs.asdict(cfg)
    for k in ("aggregated", "prefill_control_port", "prefill_admin_port", "page_size", "num_pages", "token_budget",
              "chunk_size", "max_batch"):
        dec.pop(k, None)  # the decode point fixes the shapes
    dec.pop("secret", None)
    dec.update(model=model, secret_file=str(secret), prefill=[f"127.0.0.1:{control}"])
    decode = _write(workdir / "decode.toml", dec)
    return prefill, decode, control, admin


def run(cfg: ServeConfig, model: str) -> int:
    """The supervisor speaks for the deployment to systemd (NotifyAccess=main): READY once decode is
    ready, WATCHDOG while both children live, STOPPING/RELOADING around forwarded signals. The
    children get no NOTIFY_SOCKET of their own."""
    from trnd.daemon import notify

    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the two roles share this node's cores (trnd/__init__.py)
    with tempfile.TemporaryDirectory(prefix="trnd-serve-") as tmp:
        pre_cfg, dec_cfg, control, admin = role_configs(cfg, model, Path(tmp))
        cmd = [sys.executable, "-m", "trnd"]
        def start(role: str, cfg_path: Path) -> subprocess.Popen:
            return subprocess.Popen([*cmd, role, "--config", str(cfg_path)], env=env,
                                    preexec_fn=lambda: die_with_parent(signal.SIGTERM))

        procs = {"prefill": start("prefill", pre_cfg), "decode": start("decode", dec_cfg)}
        notify.status("starting prefill and decode")
        print(f"trnd: local deployment: prefill pid {procs['prefill'].pid} (admin http://127.0.0.1:{admin}), "
              f"decode pid {procs['decode'].pid} (API http://{cfg.host}:{cfg.port}/v1)", flush=True)
        stopping = False
        ready = False
        reloading_since: float | None = None

        def forward(signum, _frame):
            nonlocal stopping, reloading_since
            if signum in (signal.SIGTERM, signal.SIGINT):
                stopping = True
                notify.stopping("draining")
            elif signum == signal.SIGHUP:
                reloading_since = time.monotonic()
                notify.reloading("reloading prefill and decode")
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signum)

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, forward)
        backoff = 0.5
        beat = notify.watchdog_interval()
        beat = beat / 2 if beat else None  # margin: each ping waits on decode's /health
        last_beat = 0.0
        while True:
            rc = procs["decode"].poll()
            if rc is not None:
                break
            now = time.monotonic()
            if not ready and not stopping and is_ready(cfg.port, "/ready"):
                ready = True
                notify.ready(f"serving on http://{cfg.host}:{cfg.port}/v1")
            if reloading_since is not None and now - reloading_since > 1.0 and is_ready(cfg.port, "/ready"):
                reloading_since = None
                notify.ready("reloaded")
            if (beat and now - last_beat >= beat and all(p.poll() is None for p in procs.values())
                    and is_ready(cfg.port, "/health")):  # decode's /health: its engine loop is making progress
                notify.watchdog()
                last_beat = now
            if procs["prefill"].poll() == EX_CONFIG:  # a bad config does not get better by restarting
                log.error("prefill refused its configuration; stopping the deployment")
                procs["decode"].send_signal(signal.SIGTERM)
                procs["decode"].wait(30)
                return EX_CONFIG
            if procs["prefill"].poll() is not None and not stopping:
                log.warning("prefill exited with %s; restarting it in %.1f s", procs["prefill"].returncode, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 10)
                procs["prefill"] = start("prefill", pre_cfg)
            time.sleep(0.2)
        p = procs["prefill"]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        return rc if not stopping else (0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else rc)
