"""`trnd store`: the L3 remote KV store's process (the store itself is trnd/store/server.py): its
admin HTTP port, its lifecycle under systemd, its command-line flags."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from trnd.config import ConfigError, StoreConfig, load_config
from trnd.log import journal_prefix
from trnd.procs import EX_CONFIG, bind_port
from trnd.store.server import DEBUG_ENV, StoreServer

log = logging.getLogger("trnd.store")


# -- admin HTTP -------------------------------------------------------------------------------------

def build_admin_app(server: StoreServer, cfg: StoreConfig, beat):
    """The probes (trnd/http/admin.py) over the store's state and metrics, and the debug hooks in tests."""
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from trnd.http.admin import Readiness, admin_app
    from trnd.http.app import json_response
    from trnd.http.errors import APIError

    async def corrupt(request: Request) -> Response:
        try:
            h = bytes.fromhex(msgspec.json.decode(await request.body())["hash"])
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            raise APIError(400, 'The body must be {"hash": "<64 hex digits>"}', param="hash") from None
        slot = server.debug_corrupt(h)
        if slot is None:
            raise APIError(404, "No such page in the store", param="hash")
        return json_response({"slot": slot})

    async def delay(request: Request) -> Response:
        try:
            server.delay_s = max(0.0, float(msgspec.json.decode(await request.body())["s"]))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            raise APIError(400, 'The body must be {"s": seconds}', param="s") from None
        return json_response({"delay_s": server.delay_s})

    routes = []
    if server.debug:
        routes += [Route("/admin/debug/corrupt", corrupt, methods=["POST"]),
                   Route("/admin/debug/delay", delay, methods=["POST"])]
    return admin_app(routes, Readiness(progress=beat, ready=False), state=server.state,
                     metrics=lambda: store_metrics(server), api_key=cfg.http.resolved_api_key())


def store_metrics(server: StoreServer) -> bytes:
    """The store's /metrics, in the Prometheus text format the other roles use: its slots, leases and
    reservations (gauges), per-client lookups, hits, misses and bytes (counters, from its /admin/state),
    then its transfer metrics per client (transfer/metrics.py)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    st = server.state()

    class Snapshot:
        def collect(self):
            g = GaugeMetricFamily("trnd:store_slots", "Page slots by state (total, free, used, reserved, ...).",
                                  labels=["state"])
            for k, v in msgspec.structs.asdict(st.slots).items():
                if isinstance(v, int):
                    g.add_metric([k], v)
            yield g
            yield GaugeMetricFamily("trnd:store_leases", "Read leases held (pages pinned for a reader).", value=st.leases)
            yield GaugeMetricFamily("trnd:store_reservations", "Write reservations open.", value=st.reservations)
            yield GaugeMetricFamily("trnd:store_clients", "Connected clients.", value=len(st.clients))
            for key, doc in (("lookups", "Lookups served"), ("hits", "Pages found by lookups"),
                             ("misses", "Pages asked for and not found"), ("committed", "Pages written and verified"),
                             ("rejected", "Written pages that failed their checksum"),
                             ("bytes_in", "Bytes written into the store"), ("bytes_out", "Bytes leased out to readers")):
                c = CounterMetricFamily(f"trnd:store_{key}", f"{doc}, by client.", labels=["client"])
                for cl in st.clients:
                    c.add_metric([cl.name], getattr(cl, key))
                yield c
            for key in ("bytes_in", "bytes_out", "connections", "refused", "corrupt_dropped"):
                yield CounterMetricFamily(f"trnd:store_node_{key}", f"{key.replace('_', ' ')} since the store started.",
                                          value=st.counters.get(key, 0) or 0)

    reg = CollectorRegistry()
    reg.register(Snapshot())
    return generate_latest(reg) + server.xfer_metrics.render()


# -- process ----------------------------------------------------------------------------------------

def run(cfg: StoreConfig, reload_source=None) -> int:
    """Register the region, serve the control plane and the admin port, READY; stop on SIGTERM."""
    from trnd.daemon.lifecycle import Beat, Lifecycle
    from trnd.roles.runtime import http_server, run_async

    control = bind_port(cfg.http.host, cfg.control_port, "control_port")  # taken: one line, exit 1, at once
    admin_sock = bind_port(cfg.http.host, cfg.http.admin_port, "admin_port")
    with Lifecycle("store", cfg, reload_source) as life:
        life.status(f"registering {cfg.memory_gb:g} GiB with NIXL")
        try:
            server = StoreServer(cfg)
            server.admin_port = admin_sock.getsockname()[1]
        except (RuntimeError, MemoryError) as e:  # the region cannot be had (or registered)
            print(f"{journal_prefix(3)}trnd: cannot start: memory_gb = {cfg.memory_gb:g}: {e}", file=sys.stderr)
            return EX_CONFIG
        try:
            life.loop = Beat()
            app = build_admin_app(server, cfg, life.loop)
            http = http_server(app, cfg.http, sock=admin_sock)
            if server.debug:
                log.warning("%s=1: debug hooks on /admin/debug/* (tests only)", DEBUG_ENV)

            async def main() -> int:
                try:
                    ctrl = await server.serve(control)
                except OSError as e:  # listen() lost a race for the port after the bind
                    log.error("cannot listen on %s:%d: %s", cfg.http.host, cfg.control_port, e)
                    return 1
                try:
                    return await life.serve(
                        http, app.state.trnd, banner=f"trnd: store of {cfg.memory_gb:g} GiB on {cfg.http.host}:{cfg.control_port}, "
                                          f"admin http://{cfg.http.host}:{cfg.http.admin_port}", on_drain=ctrl.close,
                        also_listening=(ctrl,))
                finally:
                    ctrl.close()

            return run_async(main)
        finally:
            server.close()


def add_store_args(sub) -> None:
    p = sub.add_parser("store", help="run an L3 remote KV store (a memory node for prefix pages)",
                       description="Run a KV store: one DRAM region registered with NIXL, pages keyed by chained "
                                   "page hash, read and written directly by roles on any node.")
    p.add_argument("--config", metavar="FILE", help="TOML StoreConfig (see configs/store.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--control-port", type=int, help="control-plane TCP port (default 8300)")
    p.add_argument("--admin-port", type=int, help="HTTP port for /health, /ready, /admin/state (default 8301)")
    p.add_argument("--memory-gb", type=float, help="DRAM region for cached pages (default 4)")
    p.add_argument("--lease-s", type=float, help="how long a reader's lease pins its pages at most (default 5)")
    p.add_argument("--secret-file", help="file holding the control-plane shared secret")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def run_args(args: argparse.Namespace) -> int:
    """`trnd store` after argument parsing: load and check the config (ConfigError), then run."""
    flags = {k: v for k, v in vars(args).items() if k not in ("cmd", "config")}

    def load() -> StoreConfig:
        return load_config(StoreConfig, args.config, flags)

    cfg = load()
    try:
        cfg.resolved_secret()
        cfg.http.resolved_api_key()
    except (OSError, ValueError) as e:
        raise ConfigError(str(e).replace("\n", " ")) from None
    from trnd.log import setup_logging

    setup_logging(cfg.log_level, "store")
    return run(cfg, reload_source=load)
