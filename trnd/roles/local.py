"""`trnd serve` (default): a local disaggregated deployment on one machine. Starts N `trnd prefill` and M
`trnd decode` processes on loopback (`--prefill N --decode M`, default 1 and 1; every decode server
connects to every prefill server and picks the least loaded), and with M > 1 a `trnd router` on the
serve port in front of the decode servers (with M = 1 the decode server has the port itself). It
supervises them: a prefill or decode server that dies is restarted (its peers re-handshake; the router
takes a dead decode server out and puts it back when it answers); the API front (the router, or the one
decode server) is the deployment's lifetime. SIGTERM/SIGINT/SIGHUP are forwarded.
`trnd serve --aggregated` runs everything in one process instead."""

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
from dataclasses import dataclass
from pathlib import Path

import msgspec

from trnd import OMP_SET_BY_OPERATOR, SHARED_CORES_SPINCOUNT
from trnd.config import ConfigError, ServeConfig
from trnd.procs import EX_CONFIG, die_with_parent, free_port, is_ready

log = logging.getLogger("trnd.local")


def _write(path: Path, data: dict) -> Path:
    """Flat TOML: JSON's strings, numbers, booleans and arrays are valid TOML values."""
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items() if v is not None))
    return path


@dataclass
class Child:
    """One process of the deployment: its role, its config file, the port that answers /ready."""
    name: str  # prefill0, decode1, router
    role: str
    config: Path
    port: int  # HTTP: prefill's admin port, decode's API port, the router's port
    proc: subprocess.Popen | None = None
    backoff: float = 0.5


def role_configs(cfg: ServeConfig, model: str, workdir: Path) -> list[Child]:
    """The children's configs, prefill servers first, the API front (decode, or the router) last."""
    secret = workdir / "control_secret"
    if cfg.secret_file or cfg.secret:  # shared with stores the operator runs: use theirs
        secret.write_bytes(cfg.resolved_secret_optional())
    else:
        secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    role = {"model": model, "point": cfg.point, "dtype": cfg.dtype, "kv_cache_dtype": cfg.kv_cache_dtype,
            "backend": cfg.backend, "tp": cfg.tp,
            "kv_memory_gb": cfg.kv_memory_gb, "prefix_cache": cfg.prefix_cache, "threads": cfg.threads,
            "secret_file": str(secret), "log_level": cfg.log_level, "host_cache_gb": cfg.host_cache_gb,
            "host_policy": cfg.host_policy, "node_host_memory_gb": cfg.node_host_memory_gb,
            "store": list(cfg.store), "store_on_finish": cfg.store_on_finish, "store_deadline_s": cfg.store_deadline_s,
            "static": cfg.static, "compile_cache": cfg.compile_cache}
    children, controls = [], []
    for i in range(cfg.num_prefill):
        control = cfg.prefill_control_port + i if cfg.prefill_control_port else free_port()
        admin = cfg.prefill_admin_port + i if cfg.prefill_admin_port else free_port()
        path = _write(workdir / f"prefill{i}.toml", {**role, "host": "127.0.0.1", "control_port": control,
                                                     "admin_port": admin, "api_key": cfg.resolved_api_key(),
                                                     "drain_timeout_s": cfg.drain_timeout_s})
        children.append(Child(f"prefill{i}", "prefill", path, admin))
        controls.append(f"127.0.0.1:{control}")
    dec = msgspec.structs.asdict(cfg)
    for k in ("aggregated", "prefill_control_port", "prefill_admin_port", "page_size", "num_pages", "token_budget",
              "chunk_size", "max_batch", "num_prefill", "num_decode", "router_policy", "secret"):
        dec.pop(k, None)  # the decode point fixes the shapes
    dec.update(model=model, secret_file=str(secret), prefill=controls)
    if cfg.num_decode == 1:
        children.append(Child("decode", "decode", _write(workdir / "decode.toml", dec), cfg.port))
        return children
    targets = []
    for i in range(cfg.num_decode):
        port = free_port()
        path = _write(workdir / f"decode{i}.toml", {**dec, "host": "127.0.0.1", "port": port})
        children.append(Child(f"decode{i}", "decode", path, port))
        targets.append(f"127.0.0.1:{port}")
    router = {"host": cfg.host, "port": cfg.port, "targets": targets, "model": model, "api_key": cfg.api_key,
              "api_key_file": cfg.api_key_file, "log_level": cfg.log_level, "drain_timeout_s": cfg.drain_timeout_s,
              "max_body_bytes": cfg.max_body_bytes, "policy": cfg.router_policy}
    children.append(Child("router", "router", _write(workdir / "router.toml", router), cfg.port))
    return children


KEEP_ON_RELOAD = ("host", "port", "control_port", "admin_port", "prefill", "targets", "secret_file")


def rewrite(children: list[Child], fresh: list[Child]) -> None:
    """Reload: the children's files get the re-read config's values, but the ports, peers and secret
    they started with (what they listen on and handshaked). The count of servers needs a restart."""
    if [c.name for c in children] != [c.name for c in fresh]:
        log.warning("reload: the number of prefill/decode servers changed: needs a restart, ignored")
    for old, new in zip(children, fresh):
        if old.name != new.name:
            break
        data = msgspec.toml.decode(new.config.read_bytes())
        kept = msgspec.toml.decode(old.config.read_bytes())
        data.update({k: kept[k] for k in KEEP_ON_RELOAD if k in kept})
        _write(old.config, data)


def run(cfg: ServeConfig, model: str, reload_source=None) -> int:
    """The supervisor speaks for the deployment to systemd (NotifyAccess=main): READY once every child
    answers /ready, WATCHDOG while the API front's /health answers, STOPPING/RELOADING around forwarded
    signals. The children get no NOTIFY_SOCKET of their own."""
    from trnd.daemon import notify

    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    if not OMP_SET_BY_OPERATOR:  # the roles share this node's cores: a short spin (trnd/__init__.py)
        env["GOMP_SPINCOUNT"] = SHARED_CORES_SPINCOUNT
    with tempfile.TemporaryDirectory(prefix="trnd-serve-") as tmp:
        children = role_configs(cfg, model, Path(tmp))
        front = children[-1]

        def start(c: Child) -> None:
            c.proc = subprocess.Popen([sys.executable, "-m", "trnd", c.role, "--config", str(c.config)], env=env,
                                      preexec_fn=lambda: die_with_parent(signal.SIGTERM))

        for c in children:
            start(c)
        notify.status(f"starting {cfg.num_prefill} prefill and {cfg.num_decode} decode server(s)")
        print("trnd: local deployment: " + ", ".join(f"{c.name} pid {c.proc.pid} (http://127.0.0.1:{c.port})"
                                                     for c in children)
              + f"; API http://{cfg.host}:{cfg.port}/v1", flush=True)
        stopping, ready = False, False
        reloading_since: float | None = None

        def reread() -> None:
            """SIGHUP: re-read the deployment's config and rewrite the children's files, which each
            child then re-reads on its own SIGHUP. A bad file changes nothing."""
            if reload_source is None:
                return
            try:
                new = reload_source()
                scratch = Path(tmp) / "reload"
                scratch.mkdir(exist_ok=True)
                rewrite(children, role_configs(new, model, scratch))
            except (ConfigError, OSError, ValueError) as e:
                log.error("reload failed, keeping the running configuration: %s", str(e).replace("\n", " "))

        def forward(signum, _frame):
            nonlocal stopping, reloading_since
            if signum in (signal.SIGTERM, signal.SIGINT):
                # The front drains first; the servers behind it keep serving until it is done.
                stopping = True
                notify.stopping("draining")
                if front.proc.poll() is None:
                    front.proc.send_signal(signum)
                return
            reloading_since = time.monotonic()
            notify.reloading("reloading the deployment")
            reread()
            for c in children:
                if c.proc.poll() is None:
                    c.proc.send_signal(signum)

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, forward)
        beat = notify.watchdog_interval()
        beat = beat / 2 if beat else None  # margin: each ping waits on the front's /health
        last_beat = 0.0
        while (rc := front.proc.poll()) is None:
            now = time.monotonic()
            if not ready and not stopping and all(is_ready(c.port, "/ready") for c in children):
                ready = True
                notify.ready(f"serving on http://{cfg.host}:{cfg.port}/v1")
            if reloading_since is not None and now - reloading_since > 1.0 and is_ready(cfg.port, "/ready"):
                reloading_since = None
                notify.ready("reloaded")
            if beat and now - last_beat >= beat and is_ready(cfg.port, "/health"):
                notify.watchdog()
                last_beat = now
            for c in children[:-1]:
                code = c.proc.poll()
                if code == EX_CONFIG:  # a bad config does not get better by restarting
                    log.error("%s refused its configuration; stopping the deployment", c.name)
                    forward(signal.SIGTERM, None)
                    front.proc.wait(30)
                    return EX_CONFIG
                if code is not None and not stopping:
                    log.warning("%s exited with %s; restarting it in %.1f s", c.name, code, c.backoff)
                    time.sleep(c.backoff)
                    c.backoff = min(c.backoff * 2, 10)
                    start(c)
            time.sleep(0.2)
        # The front is gone: its servers go too, decode servers (draining what they hold) before the
        # prefill servers they may still be waiting on.
        for group in ([c for c in children[:-1] if c.role != "prefill"], [c for c in children if c.role == "prefill"]):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            for c in group:
                try:
                    c.proc.wait(cfg.drain_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
        return rc if not stopping else (0 if rc in (0, -signal.SIGTERM, -signal.SIGINT) else rc)
