"""Prometheus metrics, named `trnd:*` after vLLM's `vllm:*` so existing dashboards port by a rename.

Each app has its own CollectorRegistry (tests build several apps in one process). Latencies and
token counters are updated from the request path, which sees every StepOutput; the gauges are read
from the engine at scrape time, through the loop thread like every other look at engine state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from trnd import snapshot as S
from trnd.aio import within
from trnd.engine.loop import EngineLoop
from trnd.engine.output import StepOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lbl = ["model_name"]
        self.running = Gauge("trnd:num_requests_running", "Requests in the running batch.", lbl, registry=r)
        self.waiting = Gauge("trnd:num_requests_waiting", "Requests waiting to be scheduled.", lbl, registry=r)
        self.kv_usage = Gauge("trnd:kv_cache_usage_perc", "KV-cache usage: 1 means all pages are held by requests "
                              "(evictable prefix-cache pages count as free).", lbl, registry=r)
        self.cache_queries = Counter("trnd:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                     lbl, registry=r)
        self.cache_hits = Counter("trnd:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lbl,
                                  registry=r)
        self.prompt_tokens = Counter("trnd:prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r)
        self.generation_tokens = Counter("trnd:generation_tokens", "Generated tokens.", lbl, registry=r)
        self.success = Counter("trnd:request_success", "Finished requests by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("trnd:time_to_first_token_seconds", "Arrival to first token.", lbl,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("trnd:inter_token_latency_seconds", "Time between consecutive output tokens.", lbl,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("trnd:e2e_request_latency_seconds", "Arrival to last token.", lbl,
                             buckets=_E2E_BUCKETS, registry=r)
        # Labelled by tier: host (L2) and remote (L3). The tiers' cumulative counts are counters from the
        # engine's State (_EngineCounters); these two are levels.
        tl = lbl + ["tier"]
        self.tier_pages = Gauge("trnd:kv_tier_pages_used", "Pages held in a lower KV tier.", tl, registry=r)
        self.tier_load_ms = Gauge("trnd:kv_tier_load_latency_ms_p50", "Median load latency of a tier (the latest 256 loads).", tl,
                                  registry=r)
        self.cached_by_source = Counter("trnd:prompt_tokens_cached", "Prompt tokens of finished requests whose KV was "
                                        "found, not computed, by source: device (this server's prefix cache), host "
                                        "(L2), remote (L3 store), prefill (a prefill peer's prefix cache).",
                                        lbl + ["source"], registry=r)
        self.salts = Gauge("trnd:prefix_cache_salts", "Cache salts (tenants) with pages in the device prefix cache, "
                           "beside the shared key space: each salt's pages are its own in every tier.", lbl,
                           registry=r)
        self.kernels_loaded = Gauge("trnd:cpu_kernels_loaded", "1: this process runs trnd's compiled CPU kernels; "
                                    "0: the torch ops (why: /admin/state kernels). CPU backend only.",
                                    lbl + ["build"], registry=r)
        self.last: S.State | None = None  # the engine's State at the latest scrape (the cumulative counters below)
        self.role_stats: Callable[[], dict] | None = None  # a role's cumulative counters (prefill: its requests)
        r.register(_EngineCounters(self))
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)  # export zeros so rate() works from the first scrape

    def tracker(self, arrival: float) -> RequestTracker:
        return RequestTracker(self, arrival)

    async def render(self, loop: EngineLoop, timeout: float = 2.0) -> bytes:
        """Refresh the gauges from the engine's State (trnd/snapshot.py, as /admin/state has it; skipped
        if the loop does not answer in time) and render."""
        try:
            st = await within(loop.run_on_loop(loop.engine.state), timeout)
        except (asyncio.TimeoutError, RuntimeError):
            pass  # a stuck loop: /health reports it; the counters are still worth serving
        else:
            m = self.model_name
            self.last = st
            self.running.labels(m).set(len(st.running or []))
            self.waiting.labels(m).set(len(st.waiting or []))
            pg, rad = st.pages, st.radix
            self.kv_usage.labels(m).set((pg.total - pg.free - rad.evictable_pages) / max(1, pg.total))
            self.salts.labels(m).set(rad.salts)
            self._tiers(m, st.tiers)
            if st.kernels is not None:
                self.kernels_loaded.labels(m, st.kernels.build or "none").set(int(st.kernels.loaded))
        return generate_latest(self.registry) + loop.engine.xfer_metrics.render()

    def count_finished(self, out: StepOutput) -> None:
        """One finished request's token counts (and a prefill role's, which has no RequestTracker)."""
        m = self.model_name
        self.success.labels(m, out.finish_reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(out.prompt_tokens)
        self.cache_queries.labels(m).inc(out.prompt_tokens)
        self.cache_hits.labels(m).inc(out.cached_tokens)
        for src, n in (out.cached_from or {}).items():
            self.cached_by_source.labels(m, src).inc(n)

    def _tiers(self, m: str, tiers: S.Tiers | None) -> None:
        host, remote = tiers and tiers.host, tiers and tiers.remote
        if host:
            self.tier_pages.labels(m, "host").set(host.used)
            if host.load_ms is not None and host.load_ms.p50 is not None:
                self.tier_load_ms.labels(m, "host").set(host.load_ms.p50)
        if remote and remote.load_ms is not None and remote.load_ms.p50 is not None:
            self.tier_load_ms.labels(m, "remote").set(remote.load_ms.p50)


def tier_counts(tiers: S.Tiers | None) -> dict[str, dict[str, int]]:
    """The tiers' cumulative page counts by name (hit, miss, stored, loaded, evicted) and tier."""
    out: dict[str, dict[str, int]] = {}
    host, remote = tiers and tiers.host, tiers and tiers.remote
    if host:
        for k, v in (("hit", host.hits), ("miss", host.misses), ("stored", host.stored), ("loaded", host.loaded),
                     ("evicted", host.evicted)):
            out.setdefault(k, {})["host"] = v
    if remote:
        for k, v in (("stored", remote.pages_written), ("hit", sum(s.hits for s in remote.stores)),
                     ("miss", sum(s.misses for s in remote.stores)),
                     ("loaded", sum(s.pages_loaded for s in remote.stores))):
            out.setdefault(k, {})["remote"] = v
    return out


_TIER_DOCS = {"hit": "Pages found in a lower tier at admission.", "miss": "Pages looked up and not found.",
              "stored": "Pages written down into a tier.", "loaded": "Pages loaded back from a tier.",
              "evicted": "Pages a tier dropped."}


class RequestTracker:
    """Latency bookkeeping for one engine request (one choice)."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.m = metrics
        self.arrival = arrival  # time.monotonic() when the HTTP request came in
        self.last: float | None = None
        self.done = False

    def observe(self, out: StepOutput) -> None:
        now = time.monotonic()
        m, name = self.m, self.m.model_name
        k = len(out.token_ids)
        if k:
            if self.last is None:
                m.ttft.labels(name).observe(now - self.arrival)
            else:
                gap = (now - self.last) / k  # one step normally yields one token per request
                for _ in range(k):
                    m.itl.labels(name).observe(gap)
            self.last = now
            m.generation_tokens.labels(name).inc(k)
        if out.finished:
            self.done = True
            m.e2e.labels(name).observe(now - self.arrival)
            m.count_finished(out)

    def gone(self) -> None:
        """The client left (or the request failed) before the engine finished it."""
        if not self.done:
            self.done = True
            self.m.success.labels(self.m.model_name, "abort").inc()


class _EngineCounters:
    """The engine's own cumulative counts (EngineStats, a role's counters), read from the State the
    latest scrape fetched: exported as counters, which prometheus_client only allows from a collector."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        st, m = self.m.last, self.m.model_name
        stats = st.stats if st is not None and st.stats is not None else S.Stats()
        for name, doc, v in (("trnd:num_preemptions", "Requests preempted (KV released, recomputed later).",
                              stats.preemptions),
                             ("trnd:prefill_tokens", "Prompt tokens computed (cache hits excluded).", stats.prefill_tokens),
                             ("trnd:engine_requests_finished", "Requests the engine finished.", stats.finished),
                             ("trnd:engine_requests_aborted", "Requests the engine aborted.", stats.aborted),
                             ("trnd:core_lock_wait_seconds", "Time forward passes waited for another role on "
                              "this node's cores (engine/corelock.py).", stats.core_lock_wait_s)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m], v)
            yield c
        if st is not None and st.spec is not None:  # vLLM's spec_decode counters, under trnd:
            sp = st.spec
            for name, doc, v in (("drafts", "Drafts verified (a request's drafted tokens, one forward).",
                                  sp.num_drafts),
                                 ("draft_tokens", "Tokens drafted.", sp.num_draft_tokens),
                                 ("accepted_tokens", "Drafted tokens the target kept.", sp.num_accepted_tokens)):
                c = CounterMetricFamily(f"trnd:spec_decode_num_{name}", doc, labels=["model_name"])
                c.add_metric([m], v)
                yield c
            c = CounterMetricFamily("trnd:spec_decode_num_accepted_tokens_per_pos",
                                    "Drafted tokens kept, by position in the draft.", labels=["model_name", "position"])
            for pos, v in enumerate(sp.accepted_per_pos):
                c.add_metric([m, str(pos)], v)
            yield c
        for k, by_tier in tier_counts(st.tiers if st is not None else None).items():
            c = CounterMetricFamily(f"trnd:kv_tier_{k}_pages", _TIER_DOCS[k], labels=["model_name", "tier"])
            for tier, v in by_tier.items():
                c.add_metric([m, tier], v)
            yield c
        role = self.m.role_stats() if self.m.role_stats is not None else {}
        for key, v in role.items():
            c = CounterMetricFamily(f"trnd:{key}", f"{key.replace('_', ' ')} (the role's counter).",
                                    labels=["model_name"])
            c.add_metric([m], v)
            yield c
