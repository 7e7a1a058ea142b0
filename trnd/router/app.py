"""The router's HTTP front: the decode servers' routes, each request proxied to one of them.

`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/tokenize` and `/detokenize` go to the target
trnd/router/policy.py picks (a Responses conversation, named by the conversation key in its response ids,
always to the same one, which stores it); `/v1/models` lists what the healthy targets serve; `/version`,
`/health`, `/ready`, `/metrics` and `/admin/state` describe the router. The probes, API key and error schema
are every role's (trnd/http/).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
import uuid
from dataclasses import dataclass, field

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trnd import __version__, snapshot
from trnd.config import RouterConfig
from trnd.http.admin import Readiness, admin_app
from trnd.http.app import json_response, read_body, state_of
from trnd.http.auth import key_swap
from trnd.http.errors import APIError
from trnd.http.ids import conversation_of
from trnd.http.session import session_key
from trnd.http.tenant import MAX_SALT_CHARS, bearer, tenant_salt
from trnd.router.policy import PrefixIndex, Sessions, prefix_hashes
from trnd.router.proxy import Proxied
from trnd.router.targets import Target, Targets

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (the decode servers' too)
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
MESSAGE_OVERHEAD_TOKENS = 8  # chat: the template's role markers per message, when counting with a tokenizer


class RouterMetrics:
    def __init__(self, st: "RouterState"):
        self.registry = r = CollectorRegistry()
        # model_name as on every role's series: the model its targets serve (learned from their /v1/models)
        m = ["model_name"]
        self.requests = Counter("trnd:router_requests", "Requests routed, by target and rule",
                                m + ["target", "route"], registry=r)
        self.failovers = Counter("trnd:router_failovers", "Target failures seen by requests", m + ["target"],
                                 registry=r)
        self.retries = Counter("trnd:router_retries", "Requests retried on another target", m, registry=r)
        healthy = Gauge("trnd:router_target_healthy", "1 while the target answers /ready", m + ["target"],
                        registry=r)
        in_flight = Gauge("trnd:router_target_in_flight", "Requests in flight per target", m + ["target"],
                          registry=r)
        self.kv_feed_ok = Gauge("trnd:router_kv_feed_ok", "1 while the target's KV-event feed is complete and "
                                "current; 0: stale (down, joined mid-stream, batches lost): routed by load only",
                                m + ["target"], registry=r)
        self.kv_blocks = Gauge("trnd:router_kv_index_blocks", "Blocks the KV-event index holds for the target",
                               m + ["target"], registry=r)
        r.register(_KVRoutes(st))
        entries = Gauge("trnd:router_map_entries", "Entries of the router's bounded maps (LRU)", m + ["map"],
                        registry=r)
        nbytes = Gauge("trnd:router_map_bytes", "Memory of the router's bounded maps (entries x measured entry size)",
                       m + ["map"], registry=r)
        limit = Gauge("trnd:router_map_capacity", "The maps' bounds (max_sessions, prefix_entries)", m + ["map"],
                      registry=r)
        self.client_errors = Counter("trnd:router_client_errors", "Requests refused by the router itself (400s), "
                                     "never counted against a target", m, registry=r)
        self._gauges = (healthy, in_flight, entries, nbytes, limit)
        self.st = st

    def render(self) -> bytes:
        healthy, in_flight, entries, nbytes, limit = self._gauges
        for t in self.st.targets.all:
            healthy.labels(t.model or "", t.addr).set(1 if t.healthy else 0)
            in_flight.labels(t.model or "", t.addr).set(t.in_flight)
        ev = self.st.events
        if ev is not None:
            models = {t.addr: t.model or "" for t in self.st.targets.all}
            for addr, f in ev.stats().items():
                self.kv_feed_ok.labels(models.get(addr, ""), addr).set(1 if f["state"] == "ok" else 0)
                self.kv_blocks.labels(models.get(addr, ""), addr).set(f["blocks"])
        model = self.st.model_name()
        for name, mp in (("sessions", self.st.sessions), ("prefix", self.st.index)):
            entries.labels(model, name).set(len(mp.map))
            nbytes.labels(model, name).set(mp.nbytes)
            limit.labels(model, name).set(mp.capacity)
        return generate_latest(self.registry)


class _KVRoutes:
    """trnd:router_kv_routes_total, a counter read from the KV-event routing's own counts at scrape time."""

    def __init__(self, st: "RouterState"):
        self.st = st

    def collect(self):
        ev = self.st.events
        if ev is None:
            return
        c = CounterMetricFamily("trnd:router_kv_routes", "Requests routed on the KV-event index, by outcome: hit "
                                "(a target held a prefix), miss (none did), unusable (no candidate's feed was ok: by "
                                "load), empty (the index held nothing), prefill_hit (a prefill server held it)",
                                labels=["model_name", "outcome"])
        model = self.st.model_name()
        for outcome, n in (("hit", ev.hits), ("miss", ev.misses), ("unusable", ev.unusable),
                           ("empty", ev.empty_routes), ("prefill_hit", ev.prefill_hits)):
            c.add_metric([model, outcome], n)
        yield c


@dataclass(kw_only=True)
class RouterState(Readiness):
    """`app.state.trnd` of the router: its Readiness (ready_fn: a healthy target) and what its handlers
    share."""
    cfg: RouterConfig
    client: httpx.AsyncClient
    targets: Targets
    index: PrefixIndex
    tokenizer: object | None = None  # trnd Tokenizer of the targets' model: exact prompt counts
    events: object | None = None  # router/events.py EventRouting: the targets' real caches (kv_events = true)
    target_key: str | None = None  # read at start and on reload, never per request
    # The decode servers' own body validation (api/server.py check_body, given by roles/router.py: the router's
    # room does not import api): a body of the wrong shape is their 400 here too, never a 500.
    check_body: Callable[[str, bytes], None] | None = None
    sessions: Sessions | None = None
    routed: dict[str, int] = field(default_factory=lambda: {"session": 0, "prefix": 0, "load": 0, "random": 0})
    metrics: RouterMetrics | None = None
    sprayed: int = 0
    retries: int = 0
    failovers: int = 0

    def __post_init__(self):
        self.ready_fn = lambda: bool(self.targets.healthy())
        self.not_ready_why = lambda: "no healthy decode server: " + "; ".join(
            f"{t.addr}: {t.error or 'probing'}" for t in self.targets.all)
        self.ready_hold_s = self.cfg.http.ready_hold_s
        self.target_key = self.cfg.resolved_target_key()
        self.sessions = self.sessions or Sessions(self.cfg.max_sessions)
        self.tokenizing = asyncio.Semaphore(1)  # one prompt tokenized at a time, on a worker thread

    def reload(self, cfg: RouterConfig, live: list[str]):
        """daemon/lifecycle.py Readiness.reload: targets, the key sent to them and the clients' key. Both
        key files are read now; a missing one changes nothing."""
        swap, headers, target_key = key_swap(self.auth, cfg.http), target_headers(cfg), cfg.resolved_target_key()

        def commit() -> list[str]:
            self.cfg, self.target_key = cfg, target_key
            self.targets.set_addrs(cfg.targets)
            self.targets.headers = headers
            return swap()
        return commit

    def model_name(self) -> str:
        """The model the targets serve (their /v1/models), for every series' model_name ("" until one answered)."""
        return next((t.model for t in self.targets.all if t.model), "")

    def in_flight(self) -> int:
        return sum(t.in_flight for t in self.targets.all)

    def next_spray(self) -> int | None:
        """The request's sequence number under policy = "random"; None under affinity."""
        if self.cfg.policy != "random":
            return None
        self.sprayed += 1
        return self.sprayed

    def count(self, t: Target, rule: str) -> None:
        t.requests += 1
        self.routed[rule] += 1
        self.metrics.requests.labels(t.model or "", t.addr, rule).inc()

    def count_retry(self) -> None:
        self.retries += 1
        self.metrics.retries.labels(self.model_name()).inc()

    def count_failover(self, t: Target) -> None:
        self.failovers += 1
        self.metrics.failovers.labels(t.model or "", t.addr).inc()


def target_headers(cfg: RouterConfig) -> dict[str, str]:
    """Authorization for the targets' /v1/models and /admin/state: the target key, else the router's own."""
    key = cfg.resolved_target_key() or cfg.http.resolved_api_key()
    return {"authorization": f"Bearer {key}"} if key else {}


def build_app(st: RouterState) -> Starlette:
    st.metrics = RouterMetrics(st)
    routes = [
        Route("/v1/chat/completions", _route("/v1/chat/completions"), methods=["POST"]),
        Route("/v1/completions", _route("/v1/completions"), methods=["POST"]),
        Route("/v1/responses", _route("/v1/responses"), methods=["POST"]),
        Route("/v1/responses/{rid}", stored_response, methods=["GET", "DELETE"]),
        Route("/tokenize", _route("/tokenize"), methods=["POST"]),
        Route("/detokenize", _route("/detokenize"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    return admin_app(routes, st, state=lambda: router_state(st), metrics=st.metrics.render,
                     api_key=st.cfg.http.resolved_api_key())


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_text(path: str, data: dict) -> str:
    """What the prompt's prefix is made of, for fit and prefix affinity (the targets render it exactly)."""
    if path == "/v1/chat/completions":
        return "".join(f"<{m.get('role')}>{_text(m.get('content'))}\n" for m in data.get("messages") or []
                       if isinstance(m, dict))
    if path == "/v1/responses":
        items = data.get("input")
        return items if isinstance(items, str) else "".join(
            _text(m.get("content") or m.get("output")) for m in items or [] if isinstance(m, dict))
    if path in TOKENIZER_PATHS:
        return ""
    p = data.get("prompt")
    return p if isinstance(p, str) else msgspec.json.encode(p).decode()


TOKENIZE_CHUNK_CHARS = 65536  # a long text is tokenized in pieces: the tokenizer's buffers stay this small


def count_tokens(tokenizer, text: str, add_special_tokens: bool, limit: int) -> int:
    """Tokens of `text`, counted piece by piece (a 3.5 MB prompt whole left the router's RSS at 1.6-1.8 GB);
    past `limit` characters, the counted part's tokens scaled by length (an estimate: the target counts
    exactly and answers 400 itself if it does not fit)."""
    part = text[:limit]
    n = sum(len(tokenizer.encode(part[i:i + TOKENIZE_CHUNK_CHARS], add_special_tokens=add_special_tokens and i == 0))
            for i in range(0, len(part), TOKENIZE_CHUNK_CHARS))
    return n if len(part) == len(text) else -(-n * len(text) // len(part))


async def needed_tokens(st: RouterState, path: str, data: dict, text: str) -> int:
    """prompt + max_tokens: counted with the model's tokenizer when the router has it (on a worker thread,
    one prompt at a time, at most max_tokenize_chars of it), else bounded by the UTF-8 byte count (a
    byte-level BPE never makes more tokens than bytes)."""
    chat = path in ("/v1/chat/completions", "/v1/responses")
    if path in TOKENIZER_PATHS:
        return 0  # no context needed: any target tokenizes
    prompt = data.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        # a batch: each prompt is its own engine request, so the longest one must fit
        return max([await needed_tokens(st, path, {**data, "prompt": p}, p if isinstance(p, str) else "")
                    for p in prompt])
    if not chat and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        n = len(prompt)  # token ids: counted as they are
    elif st.tokenizer is not None:
        async with st.tokenizing:
            n = await asyncio.to_thread(count_tokens, st.tokenizer, text, not chat, st.cfg.max_tokenize_chars)
        n += MESSAGE_OVERHEAD_TOKENS * len(data.get("messages") or []) if chat else 0
    else:
        n = len(text.encode("utf-8", errors="replace"))
    mt = data.get("max_completion_tokens") or data.get("max_tokens") or data.get("max_output_tokens")
    mt = mt if isinstance(mt, int) else (0 if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
    return n + mt


def event_blocks(st: RouterState, path: str, data: dict, salt: str | None, auth: bytes | None) -> list:
    """The prompt's blocks as its target will hash them (router/events.py): its token ids as the server makes
    them, under the salt the server will key them by (the router's, salted again with the key the router
    presents where the targets have keys: http/tenant.py). Run on a worker thread; a text past
    max_tokenize_chars is tokenized up to there (its first blocks: enough to find a cached prefix)."""
    limit = st.cfg.max_tokenize_chars
    try:
        if path == "/v1/chat/completions":
            msgs = [{"role": m.get("role"), "content": _text(m.get("content"))} for m in data.get("messages") or []
                    if isinstance(m, dict)]
            text = st.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
            ids = st.tokenizer.encode(text[:limit], add_special_tokens=False)
        else:
            p = data.get("prompt")
            ids = p if isinstance(p, list) and all(isinstance(t, int) for t in p) else (
                st.tokenizer.encode(p[:limit], add_special_tokens=True) if isinstance(p, str) else [])
    except Exception:  # a template this prompt cannot render here: no blocks (routed by load, counted a miss)
        return []
    keyed = any(t.keyed for t in st.targets.healthy())
    auth = auth.decode("latin-1") if isinstance(auth, bytes) else auth
    key = auth[7:] if keyed and auth and auth[:7].lower() == "bearer " else None
    return st.events.blocks_of(ids, tenant_salt(key, salt))


def _route(path: str):
    async def handler(request: Request):
        st: RouterState = state_of(request)
        st.refuse_if_draining()
        body = await read_body(request, st.cfg.http.max_body_bytes)
        await st.wait_serving()
        try:
            if st.check_body is not None:
                st.check_body(path, body)  # the decode servers' own 400s (a field of the wrong type, ...)
            data = msgspec.json.decode(body)
        except APIError:
            st.metrics.client_errors.labels(st.model_name()).inc()
            raise
        except msgspec.DecodeError as e:
            raise APIError(400, f"The body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:  # msgspec's nesting limit: a 400 here too, never a 500 (api/server.py _decode)
            raise APIError(400, "The request body is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "The body must be a JSON object", code="invalid_json")
        # prompt_cache_key (OpenAI's name) stands for session_id, as on the servers (api/server.py)
        field = "session_id" if data.get("session_id") is not None else "prompt_cache_key"
        session = data.get(field) or _header(request, b"x-session-id")
        if session is not None and not isinstance(session, str):
            raise APIError(400, f"{field} must be a string", param=field)
        session = session_key(session) if session else None  # hashed on entry: fixed size, safe in a header
        salt = data.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT_CHARS):
            raise APIError(400, f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters",
                           param="cache_salt")
        keyed = st.auth is not None and st.auth.expected is not None
        salt = tenant_salt(bearer(request.headers) if keyed else None, salt)
        if salt is not None and salt != data.get("cache_salt") and path not in TOKENIZER_PATHS:
            # the tenant travels on in the body (the tokenizer routes touch no cache)
            data["cache_salt"] = salt
            body = msgspec.json.encode(data)
        text = prompt_text(path, data)
        headers = {"content-type": "application/json"}
        if path == "/v1/responses":  # a conversation stays on the server that stores it
            conv = _conversation(data.get("previous_response_id")) or uuid.uuid4().hex
            session, headers["x-trnd-conversation"] = f"resp:{conv}", conv
        key = st.target_key
        auth = f"Bearer {key}".encode() if key else _header_bytes(request, b"authorization")
        if auth:
            headers["authorization"] = auth  # the client's own bytes: h11 parsed them, no CR/LF/NUL can be in them
        if session:
            headers["x-session-id"] = session
        if st.events is not None:
            async with st.tokenizing:  # the prompt's exact ids, off the loop and bounded (max_tokenize_chars)
                hashes = await asyncio.to_thread(event_blocks, st, path, data, salt, auth)
            peer, _ = st.events.prefill_for(hashes)
            if peer is not None:
                headers["x-trnd-prefill"] = peer
        else:
            hashes = prefix_hashes(text, st.cfg.prefix_block_chars, salt)
        need = await needed_tokens(st, path, data, text)
        return Proxied(st, path, body, bool(data.get("stream")), need, session, hashes, headers)
    return handler


def _conversation(response_id) -> str | None:
    return conversation_of(response_id) if isinstance(response_id, str) else None


async def stored_response(request: Request):
    """GET / DELETE /v1/responses/{id}: to the server its conversation went to (or any, for an id trnd never
    made: that server answers 404)."""
    st: RouterState = state_of(request)
    await st.wait_serving()
    rid = request.path_params["rid"]
    conv = _conversation(rid)
    key = st.target_key
    auth = f"Bearer {key}".encode() if key else _header_bytes(request, b"authorization")
    return Proxied(st, request.url.path, b"", False, 0, f"resp:{conv}" if conv else None, [],
                   {"authorization": auth} if auth else {}, method=request.method)


async def model(request: Request) -> Response:
    name = request.path_params["model"]
    listed = msgspec.json.decode((await models(request)).body)["data"]
    card = next((c for c in listed if c["id"] == name), None)
    if card is None:
        raise APIError(404, f"The model `{name}` does not exist (served: {', '.join(c['id'] for c in listed)})",
                       param="model", code="model_not_found")
    return json_response(card)


async def version(request: Request) -> Response:
    return json_response({"version": __version__})


async def models(request: Request) -> Response:
    st: RouterState = state_of(request)
    await st.wait_serving()
    cards: dict[str, dict] = {}
    for t in st.targets.healthy():
        c = cards.setdefault(t.model, {"id": t.model, "object": "model", "created": int(st.started),
                                       "owned_by": "trnd", "max_model_len": 0})
        c["max_model_len"] = max(c["max_model_len"], t.max_model_len)
    return json_response({"object": "list", "data": list(cards.values())})


def _header_bytes(request: Request, name: bytes) -> bytes | None:
    return next((v for k, v in request.scope["headers"] if k == name), None)


def _header(request: Request, name: bytes) -> str | None:
    """A header as text; a client's non-UTF-8 bytes (a Latin-1 byte in x-session-id was a 500) kept as
    surrogates, which session_key hashes like any other text."""
    raw = _header_bytes(request, name)
    return raw.decode("utf-8", "surrogateescape") if raw is not None else None


def router_state(st: RouterState) -> snapshot.State:
    """The router's part of the /admin/state schema (trnd/snapshot.py): its targets are its peers."""
    now, sessions = time.monotonic(), st.sessions.per_target()
    return snapshot.State(
        role="router", uptime_s=round(time.time() - st.started, 1), draining=st.draining,
        model=next((t.model for t in st.targets.all if t.model), None),
        routing=snapshot.Routing(**st.routed, retries=st.retries, failovers=st.failovers,
                                 prefix_entries=len(st.index.map)),
        peers=[snapshot.Peer(kind="decode", addr=t.addr, admin=t.url, healthy=t.healthy, point=t.point,
                             max_model_len=t.max_model_len, outstanding=t.in_flight, requests=t.requests,
                             sessions=sessions.get(t.addr, 0), error=t.error,
                             last_seen_s=round(now - t.last_ok, 2) if t.last_ok else None) for t in st.targets.all])
