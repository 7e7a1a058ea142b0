"""Targets and polling: which trnd processes to watch, and one HTTP client per target.

A poll asks `/admin/state` and `/ready` together under one overall deadline (shorter than the
interval), so a slow target costs one pending request and never a frozen screen or a pile-up.
Targets are `http://host:port` URLs or `unix:/run/trnd/<role>.sock` sockets (httpx's uds transport).
"""

from __future__ import annotations

import asyncio
import glob
import os
from dataclasses import dataclass

import httpx
import msgspec

from trnd import snapshot as S
from trnd.top.model import Poll

DEFAULT_TARGET = "http://127.0.0.1:8000"
CONFIG_DIR = "/etc/trnd"


@dataclass(frozen=True)
class Target:
    label: str  # how the node is named on screen
    url: str  # base URL; http://localhost for a unix socket
    uds: str | None = None
    api_key: str | None = None


def parse_target(spec: str, api_key: str | None = None) -> Target:
    """`http://host:port`, `host:port`, `:port` or `unix:/path.sock`."""
    spec = spec.strip()
    if spec.startswith("unix:"):
        path = spec.removeprefix("unix:").removeprefix("//")
        return Target(label=f"unix:{path}", url="http://localhost", uds=path, api_key=api_key)
    if "://" not in spec:
        spec = "http://" + (f"127.0.0.1{spec}" if spec.startswith(":") else spec)
    url = spec.rstrip("/")
    return Target(label=url.split("://", 1)[1], url=url, api_key=api_key)


def _loopback(host: str) -> str:
    """A wildcard bind address is reached on loopback from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def targets_from_configs(config_dir: str = CONFIG_DIR, api_key: str | None = None) -> list[Target]:
    """One target per role config in `config_dir/*.toml`: the admin URL from host and port (serve,
    decode), admin_port (prefill, store), plus a local serve's prefill_admin_port when it is fixed.
    The role comes from the file name, else from its fields."""
    out = []
    for path in sorted(glob.glob(os.path.join(config_dir, "*.toml"))):
        try:
            with open(path, "rb") as f:
                cfg = msgspec.toml.decode(f.read())
        except (OSError, msgspec.DecodeError):
            continue
        if not isinstance(cfg, dict) or "points" in cfg:  # points.toml is not a role
            continue
        stem = os.path.splitext(os.path.basename(path))[0]
        host = _loopback(str(cfg.get("host", "127.0.0.1")))
        key = api_key or (cfg.get("api_key") if isinstance(cfg.get("api_key"), str) else None)
        if stem.startswith("store"):
            ports = [cfg.get("admin_port", 8301)]
        elif stem.startswith("prefill") or "admin_port" in cfg or "control_port" in cfg:
            ports = [cfg.get("admin_port", 8101)]
        else:  # serve or decode: the API port; a local deployment's prefill when its admin port is fixed
            ports = [cfg.get("port", 8000)] + ([cfg["prefill_admin_port"]] if cfg.get("prefill_admin_port") and
                                              not cfg.get("aggregated") else [])
        out += [parse_target(f"http://{host}:{port}", key) for port in ports]
    return out


def resolve_targets(specs: list[str], api_key: str | None = None, config_dir: str = CONFIG_DIR) -> list[Target]:
    """Arguments, else the local role configs, else the local default."""
    if specs:
        targets = [parse_target(s, api_key) for s in specs]
    else:
        targets = targets_from_configs(config_dir, api_key) or [parse_target(DEFAULT_TARGET, api_key)]
    seen: dict[str, Target] = {}
    for t in targets:
        seen.setdefault(t.label, t)  # each node once
    return list(seen.values())


def follow(targets: list[Target], timeout: float = 2.0, limit: int = 64) -> list[Target]:
    """The targets and every node they name in /admin/state (a decode server's prefill peers, a router's decode
    servers, a role's L3 stores: their `admin` URLs), breadth first, each once: `trnd top` on a deployment's
    front port shows all of it. A target that does not answer stays in the list (its panel says why)."""
    out = {t.label: t for t in targets}
    queue = list(targets)
    with httpx.Client(timeout=timeout) as http:
        while queue and len(out) < limit:
            t = queue.pop(0)
            if t.uds:
                continue
            try:
                r = http.get(f"{t.url}/admin/state",
                             headers={"Authorization": f"Bearer {t.api_key}"} if t.api_key else {})
                state = S.decode(r.content) if r.status_code == 200 else None
            except (httpx.HTTPError, msgspec.DecodeError):
                state = None
            if state is None:
                continue
            remote = state.tiers.remote if state.tiers is not None else None
            urls = [p.admin for p in state.peers or []] + [s.admin for s in (remote.stores if remote else [])]
            for url in urls:
                if url and url.split("://", 1)[-1] not in out:
                    node = parse_target(url, t.api_key)
                    out[node.label] = node
                    queue.append(node)
    return list(out.values())


def _error_message(r: httpx.Response) -> str:
    try:
        msg = r.json()["error"]["message"]
    except Exception:
        msg = r.text[:80]
    return f"HTTP {r.status_code}: {msg}"


class Client:
    """Talks to one target. `poll()` never raises: a failure is a Poll with kind and error."""

    def __init__(self, target: Target, timeout: float):
        self.target = target
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        transport = httpx.AsyncHTTPTransport(uds=target.uds) if target.uds else None
        self.http = httpx.AsyncClient(base_url=target.url, headers=headers, transport=transport, timeout=timeout)

    async def _get(self, path: str) -> httpx.Response | httpx.HTTPError:
        try:
            return await self.http.get(path)
        except httpx.HTTPError as e:
            return e

    async def poll(self) -> Poll:
        try:
            async with asyncio.timeout(self.timeout):  # one deadline for both requests
                async with asyncio.TaskGroup() as tg:
                    state_task = tg.create_task(self._get("/admin/state"))
                    ready_task = tg.create_task(self._get("/ready"))
        except TimeoutError:
            return Poll(None, kind="slow", error=f"no answer in {self.timeout:g} s")
        state, ready = state_task.result(), ready_task.result()
        if isinstance(state, httpx.TimeoutException):
            return Poll(None, kind="slow", error=f"no answer in {self.timeout:g} s")
        if isinstance(state, httpx.ConnectError):
            return Poll(None, kind="unreachable", error=_connect_reason(state))
        if isinstance(state, httpx.HTTPError):
            return Poll(None, kind="unreachable", error=type(state).__name__)
        status = None
        if isinstance(ready, httpx.Response):
            try:
                status = ready.json().get("status")
            except (ValueError, AttributeError):
                pass
        if state.status_code != 200:
            return Poll(None, ready=status, kind="error", error=_error_message(state))
        try:
            body = S.decode(state.content)
        except msgspec.ValidationError as e:
            return Poll(None, ready=status, kind="error", error=f"/admin/state is not a trnd state: {e}")
        except msgspec.DecodeError:
            return Poll(None, ready=status, kind="error", error="/admin/state is not JSON")
        return Poll(body, ready=status)

    async def post(self, path: str) -> tuple[bool, str]:
        """An admin action: (ok, what it answered, in a few words)."""
        try:
            r = await self.http.post(path, timeout=max(self.timeout, 6.0))  # the server waits up to 5 s on its loop
        except httpx.HTTPError as e:
            return False, f"{self.target.label}: {type(e).__name__}"
        if r.status_code != 200:
            return False, f"{self.target.label}: {_error_message(r)}"
        return True, f"{self.target.label}: {r.text.strip()}"

    async def aclose(self) -> None:
        await self.http.aclose()


def _connect_reason(e: BaseException) -> str:
    seen = e
    while seen is not None:  # httpx wraps the OS error (async: anyio's "All connection attempts failed")
        if isinstance(seen, ConnectionRefusedError) or "refused" in str(seen).lower():
            return "connection refused"
        if isinstance(seen, FileNotFoundError):
            return "no such socket"
        if isinstance(seen, PermissionError):
            return "permission denied"
        if "name or service" in str(seen).lower() or "nodename" in str(seen).lower():
            return "unknown host"
        seen = seen.__cause__ or seen.__context__
    return "cannot connect"


async def poll_all(targets: list[Target], timeout: float) -> list[Poll]:
    """One poll of every target at once (for `--once`)."""
    clients = [Client(t, timeout) for t in targets]
    try:
        return list(await asyncio.gather(*(c.poll() for c in clients)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
