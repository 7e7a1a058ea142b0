"""The decode servers a router fronts: what each serves (learned from the server), whether it is healthy.

A target is probed on `/ready` every probe_s; fail_after failed probes in a row take it out, and so
does a request whose connection fails (at once: a dead server's sessions move within a probe period
or less). A target that answers again is put back. Its context length comes from its own
`/v1/models` (`max_model_len`, what its decode point holds), its point name from `/admin/state`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger("trnd.router")


@dataclass
class Target:
    addr: str  # host:port of its HTTP API
    healthy: bool = False
    model: str | None = None
    max_model_len: int | None = None
    point: str | None = None
    in_flight: int = 0
    requests: int = 0
    failed_probes: int = 0
    error: str | None = None
    last_ok: float = 0.0
    keyed: bool | None = None  # it asks for an API key (so it salts each tenant's pages by the key: http/tenant.py)

    @property
    def url(self) -> str:
        return f"http://{self.addr}"


class Targets:
    def __init__(self, addrs: list[str], client: httpx.AsyncClient, *, probe_s: float, probe_timeout_s: float,
                 fail_after: int, headers: dict[str, str]):
        self.all = [Target(a) for a in addrs]
        self.client = client
        self.probe_s, self.probe_timeout_s, self.fail_after = probe_s, probe_timeout_s, fail_after
        self.headers = headers  # Authorization for the targets' /v1/models and /admin/state
        self.on_state = None  # called with (target, its /admin/state) when learned (router/events.py: its feed)

    def healthy(self) -> list[Target]:
        return [t for t in self.all if t.healthy and t.max_model_len]

    def set_addrs(self, addrs: list[str]) -> None:
        """Reload: keep what is known of targets that stay, forget the rest."""
        known = {t.addr: t for t in self.all}
        self.all = [known.get(a) or Target(a) for a in addrs]

    def take_out(self, t: Target, why: str) -> None:
        if t.healthy:
            log.warning("target %s taken out: %s", t.addr, why)
        t.healthy, t.error, t.failed_probes = False, why, max(t.failed_probes, self.fail_after)
        t.max_model_len = None  # learned again when it answers: a restarted server may publish elsewhere

    async def run(self) -> None:
        """Probe every target every probe_s, all at once, forever (cancelled at shutdown)."""
        while True:
            t0 = time.monotonic()
            await asyncio.gather(*(self.probe(t) for t in list(self.all)))
            await asyncio.sleep(max(0.0, self.probe_s - (time.monotonic() - t0)))

    async def probe(self, t: Target) -> None:
        try:
            r = await self.client.get(f"{t.url}/ready", timeout=self.probe_timeout_s)
            ok, why = r.status_code == 200, f"/ready answered {r.status_code}"
            if ok and t.max_model_len is None:
                await self._learn(t)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            ok, why = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if ok:
            if not t.healthy:
                log.info("target %s healthy (%s, max_model_len %s, point %s)", t.addr, t.model, t.max_model_len,
                         t.point)
            t.healthy, t.failed_probes, t.error, t.last_ok = True, 0, None, time.monotonic()
            return
        t.failed_probes += 1
        if t.failed_probes >= self.fail_after:
            self.take_out(t, why)
        t.error = why

    async def _learn(self, t: Target) -> None:
        r = await self.client.get(f"{t.url}/v1/models", headers=self.headers, timeout=self.probe_timeout_s)
        r.raise_for_status()
        card = r.json()["data"][0]
        t.model, t.max_model_len = card["id"], int(card["max_model_len"])
        try:  # the point's name, for the operator (a target without admin access still routes by context)
            s = await self.client.get(f"{t.url}/admin/state", headers=self.headers, timeout=self.probe_timeout_s)
            if s.status_code == 200:
                state = s.json()
                t.point = state.get("point")
                if self.on_state is not None:
                    self.on_state(t, state)
            bare = await self.client.get(f"{t.url}/v1/models", timeout=self.probe_timeout_s)
            t.keyed = bare.status_code == 401
        except (httpx.HTTPError, ValueError):
            pass
