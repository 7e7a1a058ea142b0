"""`trnd serve` (default): a local disaggregated deployment on one machine. Starts N `trnd prefill` and M
`trnd decode` processes on loopback (`--prefill N --decode M`, default 1 and 1; every decode server
connects to every prefill server and picks the least loaded), and with M > 1 a `trnd router` on the
serve port in front of the decode servers (with M = 1 the decode server has the port itself).

It knows its children by pid: each speaks the notify protocol to the supervisor's own socket (the
kernel names the sender), READY=1 with the ports it bound (X_TRND_LISTEN), so another process on a
port never counts as one of them. Their ports come from the config or flags (prefill_control_port,
prefill_admin_port, decode_port; unset: free ports, printed), tried before any child starts: one in
use is one line and exit 1. A child that fails before the deployment was first ready stops it with
the child's status; after that a prefill or decode server that dies is restarted (its peers
re-handshake; the router takes a dead decode server out and puts it back when it answers); the API
front (the router, or the one decode server) is the deployment's lifetime. SIGTERM/SIGINT/SIGHUP are
forwarded. `trnd serve --aggregated` runs everything in one process instead."""

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
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from trnd.tuning import SHARED_CORES_SPINCOUNT, omp_set_by_operator
from trnd.config import ConfigError, LocalConfig
from trnd.daemon import notify
from trnd.log import ROLE_ENV
from trnd.procs import EX_CONFIG, bind_port, die_with_parent, free_port

log = logging.getLogger("trnd.local")


def _toml(v) -> str:
    """JSON's strings, numbers, booleans and arrays are valid TOML values; a table is written inline."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items() if x is not None) + "}"
    return json.dumps(v)


def _write(path: Path, data: dict) -> Path:
    path.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in data.items() if v is not None))
    return path


def _child_events(cfg: LocalConfig) -> dict | None:
    """The children's KV events: each binds its own ephemeral ports (one fixed endpoint cannot serve them all)."""
    if cfg.kv_events is None:
        return None
    return {**msgspec.structs.asdict(cfg.kv_events), "endpoint": None, "replay_endpoint": None}


@dataclass
class Child:
    """One process of the deployment: its role, its config file, the ports it must bind (the first
    answers HTTP: prefill's admin port, decode's API port, the router's port), and what the supervisor
    has heard from it over its own notify socket since it was last started."""
    name: str  # prefill0, decode1, router
    role: str
    config: Path
    ports: dict[str, int]  # field (as the operator names it) -> port
    proc: subprocess.Popen | None = None
    backoff: float = 0.5
    ready: bool = False  # READY=1 came from this pid, with every one of `ports` in X_TRND_LISTEN
    listening: list[str] = field(default_factory=list)
    status: str = "starting"
    pinged: float = 0.0  # its last WATCHDOG=1 (or its start)
    readies: int = 0  # READY=1 messages since its start: a reload is over when each child sent one more
    heard: bool = False  # any message since its start (before the first, it is importing: START_GRACE_S)

    @property
    def port(self) -> int:
        return next(iter(self.ports.values()))


def role_configs(cfg: LocalConfig, model: str, workdir: Path) -> list[Child]:
    """The children's configs, prefill servers first, the API front (decode, or the router) last: each
    gets the parts it applies (config.py), nothing copied by hand."""
    secret = workdir / "control_secret"
    if cfg.secret_file or cfg.secret:  # shared with stores the operator runs: use theirs
        secret.write_bytes(cfg.resolved_secret_optional())
    else:
        secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    asdict, plain = msgspec.structs.asdict, msgspec.to_builtins  # plain: [remote], speculative_config as tables
    lock = cfg.engine.core_lock or (str(workdir / "cores.lock") if cfg.deploy.share_cores else None)
    role = {"model": model, "point": cfg.point, "secret_file": str(secret), "log_level": cfg.log_level,
            **plain(cfg.engine), **plain(cfg.tiers), "core_lock": lock, "kv_events": _child_events(cfg)}
    children, controls = [], []
    for i in range(cfg.deploy.num_prefill):
        control = cfg.deploy.prefill_control_port + i if cfg.deploy.prefill_control_port else free_port()
        admin = cfg.deploy.prefill_admin_port + i if cfg.deploy.prefill_admin_port else free_port()
        path = _write(workdir / f"prefill{i}.toml", {**role, "compile_decode": None,  # it runs no decode step
                                                     "host": "127.0.0.1", "control_port": control,
                                                     "admin_port": admin, "api_key": cfg.http.resolved_api_key(),
                                                     "drain_timeout_s": cfg.http.drain_timeout_s})
        children.append(Child(f"prefill{i}", "prefill", path, {"prefill_admin_port": admin,
                                                                "prefill_control_port": control}))
        controls.append(f"127.0.0.1:{control}")
    dec = {**role, **asdict(cfg.http), **asdict(cfg.api), "max_model_len": cfg.max_model_len,
           "local_prefill_tokens": cfg.local_prefill_tokens, "prefill": controls}
    if cfg.deploy.num_decode == 1:
        children.append(Child("decode", "decode", _write(workdir / "decode.toml", dec), {"port": cfg.http.port}))
        return children
    targets = []
    for i in range(cfg.deploy.num_decode):
        port = cfg.deploy.decode_port + i if cfg.deploy.decode_port else free_port()
        path = _write(workdir / f"decode{i}.toml", {**dec, "host": "127.0.0.1", "port": port})
        children.append(Child(f"decode{i}", "decode", path, {"decode_port": port}))
        targets.append(f"127.0.0.1:{port}")
    router = {**asdict(cfg.http), "targets": targets, "model": model, "log_level": cfg.log_level,
              "policy": cfg.deploy.router_policy, "kv_events": cfg.kv_events is not None and cfg.kv_events.on}
    children.append(Child("router", "router", _write(workdir / "router.toml", router), {"port": cfg.http.port}))
    return children


START_GRACE_S = 60.0  # a child's imports before its first notify message, against the watchdog
RELOAD_WAIT_S = 30.0  # for every child's READY after a forwarded SIGHUP; then READY=1 regardless
# core_lock: the re-read config names its own scratch copy; a role restarted after the reload must share the lock
# the others hold (and the running ones would log it as needing a restart)
KEEP_ON_RELOAD = ("host", "port", "control_port", "admin_port", "prefill", "targets", "secret_file", "core_lock")


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


def check_ports(cfg: LocalConfig, children: list[Child]) -> None:
    """Every port a child will bind, tried here first: one that another process holds is one line
    naming its field and exit 1 (PortError) before any child loads a model. A child that then loses
    a race for one fails the same way itself."""
    socks = []
    try:
        for c in children:
            host = cfg.http.host if c is children[-1] else "127.0.0.1"
            socks += [bind_port(host, port, name) for name, port in c.ports.items()]
    finally:
        for sock in socks:
            sock.close()


def heard(c: Child, msg: dict[str, str], now: float) -> None:
    """A notify message from child `c` (its pid checked by the kernel's credentials)."""
    if "STATUS" in msg:
        c.status = msg["STATUS"]
    c.heard = True
    if "WATCHDOG" in msg or "READY" in msg:
        c.pinged = now
    if msg.get("STOPPING") == "1":
        c.ready = False
    if msg.get("READY") == "1":
        c.readies += 1
        if notify.LISTEN in msg or not c.listening:  # a reload's READY=1 names no ports: the child kept its own
            c.listening = msg.get(notify.LISTEN, "").split()
        bound = {a.rpartition(":")[2] for a in c.listening}
        missing = [f"{name} = {port}" for name, port in c.ports.items() if str(port) not in bound]
        if missing:
            log.error("%s says READY but does not listen on %s (it listens on %s)", c.name, ", ".join(missing),
                      " ".join(c.listening) or "nothing")
        c.ready = not missing


def run(cfg: LocalConfig, reload_source=None) -> int:
    """The supervisor speaks for the deployment to systemd (NotifyAccess=main). Its children speak to it
    the same protocol on a socket of its own (notify.Listener; the kernel names each sender's pid, so
    only its own children count): READY once every child sent READY=1 listening on its ports, WATCHDOG
    while every child's own pings keep coming (each pings only while its engine loop turns),
    STOPPING/RELOADING around forwarded signals. A child that fails before the deployment was first
    ready stops it with the child's exit status; after that a dead child is restarted."""
    from trnd.model.maker import resolve_model
    from trnd.points import get_point
    from trnd.roles.common import point_pool
    from trnd.transfer.backends import prepare

    prepare(cfg.engine.transfer_backend)  # one line here, not one per child
    model = str(resolve_model(cfg.model))
    # a bad model, or a point this model or this memory cannot serve: one line here, not one per child
    point_pool(get_point(cfg.point), Path(model), cfg.engine, cfg.engine.static or cfg.engine.compile_cache is not None)
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    if not omp_set_by_operator() and not cfg.deploy.share_cores:
        # the roles compute on this node's cores at once: a short spin (trnd/tuning.py); taking turns
        # (share_cores, engine/corelock.py) each keeps the spin of a role alone
        env["GOMP_SPINCOUNT"] = SHARED_CORES_SPINCOUNT
    watchdog_s = notify.watchdog_interval()
    with tempfile.TemporaryDirectory(prefix="trnd-serve-") as tmp:
        children = role_configs(cfg, model, Path(tmp))
        front = children[-1]
        check_ports(cfg, children)
        listener = notify.Listener(str(Path(tmp) / "notify"))  # the directory is ours alone (0700)
        env["NOTIFY_SOCKET"] = listener.path
        if watchdog_s:
            env["WATCHDOG_USEC"] = str(int(watchdog_s * 1e6))

        def start(c: Child) -> None:
            c.ready, c.listening, c.status, c.readies, c.heard = False, [], "starting", 0, False
            c.pinged = time.monotonic()
            # -P: the working directory stays off the child's sys.path, so a `trnd/` folder there (a checkout
            # beside an installed trnd) is never what the child imports
            # Its own session: a terminal's Ctrl-C reaches this supervisor only, which drains the deployment
            # in order (the front, then decode, then prefill) instead of every child stopping at once.
            c.proc = subprocess.Popen([sys.executable, "-P", "-m", "trnd", c.role, "--config", str(c.config)],
                                      env={**env, ROLE_ENV: c.name}, start_new_session=True,
                                      preexec_fn=lambda: die_with_parent(signal.SIGTERM))

        for c in children:
            start(c)
        notify.status(f"starting {cfg.deploy.num_prefill} prefill and {cfg.deploy.num_decode} decode server(s)")
        print("trnd: local deployment: " + ", ".join(
            f"{c.name} pid {c.proc.pid} (http://127.0.0.1:{c.port})"
            + "".join(f" {k} {v}" for k, v in list(c.ports.items())[1:]) for c in children)
              + f"; API http://{cfg.http.host}:{cfg.http.port}/v1", flush=True)
        stopping, ready = False, False
        reload_at: dict[str, int] | None = None  # each child's READY count when SIGHUP was forwarded
        reload_since = 0.0

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
            nonlocal stopping, reload_at, reload_since
            if signum in (signal.SIGTERM, signal.SIGINT):
                if stopping:  # a second one: every child stops now, without waiting for requests
                    log.warning("%s again: stopping every role now", signal.Signals(signum).name)
                    for c in children:
                        if c.proc.poll() is None:
                            c.proc.send_signal(signum)
                    return
                # The front drains first; the servers behind it keep serving until it is done.
                stopping = True
                log.info("%s: draining the deployment (the front first; again to stop at once)",
                         signal.Signals(signum).name)
                notify.stopping("draining")
                if front.proc.poll() is None:
                    front.proc.send_signal(signum)
                return
            reload_at, reload_since = {c.name: c.readies for c in children}, time.monotonic()
            notify.reloading("reloading the deployment")
            reread()
            for c in children:
                if c.proc.poll() is None:
                    c.proc.send_signal(signum)

        def shut_down() -> None:
            """Decode servers (draining what they hold) before the prefill servers they may wait on."""
            for group in ([c for c in children if c.role != "prefill"], [c for c in children if c.role == "prefill"]):
                for c in group:
                    if c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGTERM)
                for c in group:
                    try:
                        c.proc.wait(cfg.http.drain_timeout_s + 15)
                    except subprocess.TimeoutExpired:
                        c.proc.kill()
                        c.proc.wait()

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, forward)
        last_beat, shown, silent = 0.0, "", set()
        try:
            while (rc := front.proc.poll()) is None:
                now = time.monotonic()
                for pid, msg in listener.receive():
                    c = next((c for c in children if c.proc.pid == pid), None)
                    if c is None:  # a rank process, or anyone else who found the socket: not a child's word
                        log.debug("notify message from pid %s (not a child): ignored", pid)
                        continue
                    heard(c, msg, now)
                    if not ready and "EXTEND_TIMEOUT_USEC" in msg:
                        notify.notify(f"EXTEND_TIMEOUT_USEC={msg['EXTEND_TIMEOUT_USEC']}")  # a slow load
                if not ready and not stopping:
                    text = "starting: " + "; ".join(f"{c.name}: {c.status}" for c in children)
                    if text != shown:
                        notify.status(text)
                        shown = text
                    if all(c.ready for c in children):
                        ready = True
                        log.info("deployment ready: %s", ", ".join(f"{c.name} pid {c.proc.pid} on "
                                                                   f"{' '.join(c.listening)}" for c in children))
                        notify.ready(f"serving on http://{cfg.http.host}:{cfg.http.port}/v1")
                if reload_at is not None and (all(c.readies > reload_at[c.name] for c in children)
                                              or now - reload_since > RELOAD_WAIT_S):
                    late = [c.name for c in children if c.readies <= reload_at[c.name]]
                    if late:
                        log.warning("reload: %s did not confirm within %g s", ", ".join(late), RELOAD_WAIT_S)
                    reload_at = None
                    notify.ready("reloaded" + (f" ({', '.join(late)} did not confirm)" if late else ""))
                if watchdog_s and now - last_beat >= watchdog_s / 2:
                    quiet = {c.name for c in children if c.proc.poll() is None
                             and now - c.pinged > (watchdog_s if c.heard else max(watchdog_s, START_GRACE_S))}
                    for name in sorted(quiet - silent):
                        log.warning("%s sent no watchdog ping for %g s (a hung engine step?): the deployment's "
                                    "pings stop", name, watchdog_s)
                    silent = quiet
                    if not quiet:
                        notify.watchdog()
                        last_beat = now
                for c in children[:-1]:
                    code = c.proc.poll()
                    if code is None or stopping:
                        continue
                    if code == EX_CONFIG or not ready:  # a bad config does not get better by restarting
                        log.warning("%s exited with %s before the deployment was ready: stopping it" if not ready
                                    else "%s refused its configuration (exit %s): stopping the deployment",
                                    c.name, code)
                        notify.stopping(f"{c.name} exited with {code}")
                        return exit_status(code)  # shut_down() stops the others
                    log.warning("%s exited with %s; restarting it in %.1f s", c.name, code, c.backoff)
                    time.sleep(c.backoff)
                    c.backoff = min(c.backoff * 2, 10)
                    start(c)
                time.sleep(0.2)
            if not stopping:
                log.warning("%s exited with %s%s: stopping the deployment", front.name, rc,
                            "" if ready else " before the deployment was ready")
        finally:
            shut_down()  # the front is gone: its servers go too
            listener.close()
        return 0 if stopping and rc in (-signal.SIGTERM, -signal.SIGINT) else exit_status(rc)


def exit_status(code: int) -> int:
    """A child's status as the supervisor's own: a signal N as the shell says it (128 + N)."""
    return code if code >= 0 else 128 - code
