"""Typed role configuration: each role's msgspec Struct, composed from typed parts, loaded from TOML and
validated once at start.

The parts: `EngineKnobs` (what the engine is: dtype, TP, pool, graphs), `TierConfig` (L2 and L3 below the
prefix cache), `HTTPConfig` (a front's port, key, limits and drain), `AdminPort` (the admin port of a role
with no OpenAI front), `APIConfig` (the OpenAI routes' limits and parsers), `Shapes` (the aggregated
server's own; a disaggregated role's come from its decode point) and `Deployment` (what only `trnd serve`'s
supervisor reads). A role's config holds the parts it applies, so a flag a role or mode cannot apply is
an unknown field: refused, never ignored. TOML and flags stay flat (`dtype = ...`, not `[engine]`):
`load_config` files each key into its part, and errors name the flat field.

Errors are one line naming the file and the field (msgspec's `- at $.field` path), so a bad config
exits with EX_CONFIG and a message an operator can act on. Command-line flags override file values.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Port = Annotated[int, Meta(ge=0, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
PageSize = Annotated[int, Meta(ge=1, le=4096)]
Seconds = Annotated[float, Meta(gt=0)]
LogLevel = Literal["debug", "info", "warning", "error"]
TransferBackend = Literal["ucx", "libfabric"]


class ConfigError(ValueError):
    """A bad config file or flag value; the message is one line naming the field."""


class StartupError(RuntimeError):
    """A role that must not start (pool too small for the point, bad layout): one line, exit EX_CONFIG."""


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's --kv-events-config (vllm/config/kv_events.py), key for key: the engine's prefix cache publishes
    what it stores and drops (trnd/events). The same JSON works on `--kv-events-config` here and on vLLM; in
    TOML it is a table, [kv_events]."""
    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when enabled
    endpoint: str | None = None  # PUB; None: tcp://<the role's host>:0 (an ephemeral port, in /admin/state)
    replay_endpoint: str | None = None  # ROUTER for replays; None: tcp://<the role's host>:0 as well
    buffer_steps: Positive = 10_000  # batches kept for replay
    hwm: Positive = 100_000
    max_queue_size: Positive = 100_000
    topic: str = ""
    # trnd's: how block hashes are made, as vLLM's --prefix-caching-hash-algo and PYTHONHASHSEED make them
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    hash_seed: str | None = None  # None: $PYTHONHASHSEED, else vLLM's fixed seed

    @property
    def on(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


class Part(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A typed part of a role's config; its fields are flat keys in TOML and flags."""


def _invalid(field: str, why: str) -> msgspec.ValidationError:
    return msgspec.ValidationError(f"{why} - at `$.{field}`")


def _read(field: str, value: str | None, file: str | None) -> str | None:
    """A key given inline or (preferred) in a file, e.g. $CREDENTIALS_DIRECTORY/api_key under systemd."""
    if file:
        return read_key_file(f"{field}_file", file).decode()
    return value


# Keys given inline; each has a `<name>_file` twin. An empty one would turn authentication off (a key of ""
# matches no header, or HMACs with no secret): refused, like an empty or missing file, at start and on reload.
KEY_FIELDS = ("api_key", "target_api_key", "secret")


def read_key_file(field: str, path: str) -> bytes:
    """A key or secret file's content, stripped; fails closed: a file that is missing, unreadable or empty
    is a ConfigError naming the field (at start: exit 78; on reload: the running key is kept). An API key
    must be text (it travels in a header); a control-plane secret may be any bytes."""
    try:
        data = Path(os.path.expandvars(path)).read_bytes().strip()
        if "api_key" in field:
            data.decode("ascii")
    except OSError as e:
        raise ConfigError(f"{field} = {path!r}: {e.strerror or e} - at `$.{field}`") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{field} = {path!r} holds bytes that are not ASCII: an API key travels in an HTTP "
                          f"header - at `$.{field}`") from None
    if not data:
        raise ConfigError(f"{field} = {path!r} is empty: a key file must hold the key (unset {field} to run "
                          f"without one) - at `$.{field}`")
    return data


def _check_files(cfg) -> None:
    """Every `*_file` setting read now (one line naming it, never a traceback later), every key non-empty."""
    for field, value in flat(cfg).items():
        if field.endswith("_file") and value is not None:
            try:
                read_key_file(field, value)
            except ConfigError as e:
                raise msgspec.ValidationError(str(e)) from None
        elif field in KEY_FIELDS and value is not None and not value.strip():
            raise msgspec.ValidationError(f"{field} is empty: unset it to run without a key - at `$.{field}`")


# -- the parts ----------------------------------------------------------------------------------------

def engine_conflict(*, static: bool, compile_cache: str | None, compile_decode: bool, tp: int, backend: str,
                    kv_cache_dtype: str) -> tuple[str, str] | None:
    """(field, why) when these engine settings cannot run together, else None: the static path (and a compile
    cache, its graphs) runs one rank on model-dtype pages (engine/static.py); compile_decode
    (engine/compiled.py) one CPU rank on model-dtype pages, not beside the static path. The one place these
    rules live: role configs (EngineKnobs) and the engine (engine/build.py EngineConfig) both ask."""
    static_on = static or compile_cache is not None
    field = "static" if static else "compile_cache"
    if static_on and tp > 1:
        return field, f"{field} runs one rank: tp = {tp} must be 1"
    if static_on and kv_cache_dtype != "auto":
        return field, f"{field} keeps KV in the model dtype: kv_cache_dtype = {kv_cache_dtype!r} runs on the eager path"
    if compile_decode:
        for bad, why in ((backend != "cpu", f"backend = {backend!r} (it compiles for the CPU)"),
                         (tp > 1, f"tp = {tp} (it runs one rank)"),
                         (static_on, "static (the static path compiles every step already)"),
                         (kv_cache_dtype != "auto",
                          f"kv_cache_dtype = {kv_cache_dtype!r} (it reads model-dtype pages)")):
            if bad:
                return "compile_decode", f"compile_decode does not go with {why}"
    return None


class EngineKnobs(Part):
    """What the engine is, on every role that runs one. A new engine flag is a field here and a flag in
    cli.py `_engine_flags`; engine/build.py EngineConfig.from_role takes it over."""
    # auto: the checkpoint's, or float32 on a CPU without native bf16 (backends/cpu.py)
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"  # fp8: fp8 pages + scales
    backend: Literal["cpu", "cuda", "neuron"] = "cpu"
    tp: Annotated[int, Meta(ge=1, le=64)] = 1  # tensor-parallel ranks (processes)
    threads: Positive | None = None  # torch intra-op threads (per rank)
    kv_memory_gb: Annotated[float, Meta(gt=0)] = 1.0
    prefix_cache: bool = True
    static: bool = False  # every step padded to the point's buckets, one compiled graph each (engine/static.py)
    compile_cache: str | None = None  # a `trnd compile` dir: its graphs are loaded, none compiled (implies static)
    compile_decode: bool = False  # CPU: decode-only steps as one inductor graph, compiled at start (engine/compiled.py)
    # A file every role on this node's cores locks around each forward pass, so they take turns instead of
    # oversubscribing the cores (engine/corelock.py); `trnd serve` sets one for its roles. None: off.
    core_lock: str | None = None
    # The NIXL backend that moves KV pages between roles and to L3 stores: "ucx", or "libfabric" (EFA's
    # path; its tcp provider elsewhere). Both ends must name the same one (the handshake refuses a
    # mismatch); transfer/backends.py says what libfabric needs.
    transfer_backend: TransferBackend = "ucx"

    def __post_init__(self):
        bad = engine_conflict(static=self.static, compile_cache=self.compile_cache, compile_decode=self.compile_decode,
                              tp=self.tp, backend=self.backend, kv_cache_dtype=self.kv_cache_dtype)
        if bad is not None:
            raise _invalid(*bad)
        lock = self.core_lock
        if lock is not None and not os.path.isdir(os.path.dirname(os.path.abspath(lock))):
            raise _invalid("core_lock", f"core_lock = {lock!r}: its directory does not exist")


class TierConfig(Part):
    """The tiers below the prefix cache: L2 host DRAM, L3 remote stores (trnd/cache/tiers.py)."""
    host_cache_gb: Annotated[float, Meta(ge=0)] = 0.0  # L2: evicted prefix pages kept in host DRAM; 0 = off
    host_policy: Literal["write-back", "write-through"] = "write-back"  # on eviction, or on finish
    node_host_memory_gb: Annotated[float, Meta(gt=0)] | None = None  # budget shared by all trnd processes
    store: list[str] = msgspec.field(default_factory=list)  # L3 remote KV stores, host:port; [] = off
    store_on_finish: bool = True  # write finished requests' full pages to L3 (sessions across roles)
    store_deadline_s: Seconds = 1.0  # a slower store is a cache miss


class HTTPConfig(Part):
    """An HTTP front's port (serve, decode, router): where it listens, its key and its limits."""
    host: str = "127.0.0.1"  # every listener of the role binds here (loopback by default)
    port: Port = 8000
    api_key: str | None = None  # None: open; else required on /v1/* and /admin/*
    api_key_file: str | None = None  # e.g. $CREDENTIALS_DIRECTORY/api_key under systemd
    max_body_bytes: Positive = 4 * 2**20
    max_header_bytes: Positive = 64 * 2**10  # request line + headers; beyond: 431
    header_timeout_s: Seconds = 10.0  # the headers must be in by then, or the connection is closed
    # A request that arrives before the server can serve it (starting, a decode server with no prefill peer,
    # a router with no healthy target) is held this long, then answered 503 with Retry-After.
    ready_hold_s: Annotated[float, Meta(ge=0)] = 30.0
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0  # SIGTERM: in-flight requests may finish this long

    def resolved_api_key(self) -> str | None:
        return _read("api_key", self.api_key, self.api_key_file)


class AdminPort(Part):
    """The HTTP port of a role with no OpenAI front (prefill, store): probes, /metrics, /admin."""
    host: str = "127.0.0.1"  # every listener of the role binds here (loopback by default)
    admin_port: Port = 8101
    api_key: str | None = None  # for /admin/* on the admin port
    api_key_file: str | None = None
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0  # SIGTERM: in-flight work may finish this long

    def resolved_api_key(self) -> str | None:
        return _read("api_key", self.api_key, self.api_key_file)


class APIConfig(Part):
    """The OpenAI routes (serve, decode): admission and per-request limits, how replies are parsed."""
    served_model_name: str | None = None
    max_requests: Positive = 1024  # in flight; beyond this new requests get 503 + Retry-After
    max_n: Annotated[int, Meta(ge=1, le=128)] = 16
    max_stop: Positive = 4  # stop sequences per request (OpenAI's limit)
    max_stop_chars: Positive = 1024  # their total length
    max_logit_bias: Positive = 300  # logit_bias entries per request (each is added to the logits every step)
    max_stop_token_ids: Positive = 128  # stop_token_ids per request (each new token is looked up among them)
    max_job_tokens: Positive | None = None  # n x (prompt + max_tokens) of one request; None: no cap
    # How this model writes tool calls and reasoning (docs/API.md); "none" turns a parser off.
    tool_call_parser: Literal["hermes", "llama3_json", "none"] = "hermes"  # hermes: Qwen2.5/Qwen3, the default model
    reasoning_parser: Literal["qwen3", "deepseek_r1", "none"] = "none"


class Shapes(Part):
    """The aggregated server's step shapes; a disaggregated role's come from its decode point."""
    page_size: PageSize = 16
    num_pages: Positive | None = None  # None: what kv_memory_gb holds
    max_model_len: Positive | None = None  # None: the model's, capped by the pool
    max_batch: Positive = 32
    token_budget: Positive = 512
    chunk_size: Positive = 512


class Deployment(Part):
    """What only `trnd serve`'s supervisor reads (roles/local.py): how many servers, their ports."""
    num_prefill: Annotated[int, Meta(ge=1, le=16)] = 1  # prefill servers (--prefill N)
    num_decode: Annotated[int, Meta(ge=1, le=16)] = 1  # decode servers (--decode M); > 1: `trnd router` on port
    # Fixed ports for the children (None: a free port each, picked at start and printed).
    prefill_control_port: Port | None = None  # the first prefill server's; the i-th takes port + i
    prefill_admin_port: Port | None = None  # likewise (its /health, /ready, /metrics, /admin)
    decode_port: Port | None = None  # with num_decode > 1: the first decode server's API port (the router has `port`)
    # The roles take turns on the cores, one forward pass at a time (engine/corelock.py).
    share_cores: bool = True
    router_policy: Literal["affinity", "random"] = "affinity"  # the local router's (random: benchmarks)


def _check_point(point: str) -> None:
    from trnd.points import load_points

    try:
        known = load_points()
    except ValueError as e:  # a broken points file: its own message names the file and field
        raise _invalid("point", str(e)) from None
    if point not in known:
        raise _invalid("point", f"point = {point!r} is not a known decode point (known: {', '.join(sorted(known))})")


# -- the roles --------------------------------------------------------------------------------------

class Secret:
    """The control-plane shared secret (`secret`, or preferably `secret_file`) of a role that talks to peers
    or stores."""
    __slots__ = ()

    def resolved_secret_optional(self) -> bytes | None:
        if self.secret_file:
            return read_key_file("secret_file", self.secret_file)
        return self.secret.encode() if self.secret else None

    def resolved_secret(self) -> bytes:
        got = self.resolved_secret_optional()
        if not got:
            raise _invalid("secret_file", "no control-plane secret: set secret_file (or secret)")
        return got


class RoleBase(msgspec.Struct, Secret, forbid_unknown_fields=True, kw_only=True):
    """What every role that runs an engine has: its model, log level, control-plane secret, engine, tiers."""
    model: str | None = None  # None: the embedded default (a small model made on first use)
    log_level: LogLevel = "info"
    secret: str | None = None  # control-plane shared secret (peers, stores); prefer secret_file
    secret_file: str | None = None  # e.g. ${CREDENTIALS_DIRECTORY}/trnd_control_secret under systemd
    engine: EngineKnobs = msgspec.field(default_factory=EngineKnobs)
    tiers: TierConfig = msgspec.field(default_factory=TierConfig)

    def __post_init__(self):
        _check_files(self)


class FrontBase(RoleBase, kw_only=True):
    """A role with the OpenAI routes: its port and their limits."""
    http: HTTPConfig = msgspec.field(default_factory=HTTPConfig)
    api: APIConfig = msgspec.field(default_factory=APIConfig)


class PointFront(FrontBase, kw_only=True):
    """An OpenAI front whose engines run at a decode point (the local deployment, a decode server)."""
    point: str = "8k"  # fixes page size, max context, max batch and prefill chunk: every role must name the same
    max_model_len: Positive | None = None  # below the point's max context
    # Conditional disaggregation (Dynamo's max_local_prefill_length): a new prompt with at most this many
    # tokens past the decode server's own prefix-cache hit is prefilled there, mixed into the decode steps,
    # instead of handed to a prefill peer (roles/decode.py). 0: every prompt to a peer. None (auto):
    # roles/decode.py's LOCAL_PREFILL_SHARED_CORES where the roles take turns on the node's cores, else 0.
    local_prefill_tokens: Annotated[int, Meta(ge=0)] | None = None

    def __post_init__(self):
        _check_point(self.point)
        super().__post_init__()


class ServeConfig(FrontBase, kw_only=True):
    """`trnd serve --aggregated`: one process owning model, scheduler and HTTP front."""
    kv_events: KVEventsConfig | None = None  # KV events in vLLM's format (trnd/events); None: off
    shapes: Shapes = msgspec.field(default_factory=Shapes)

    def __post_init__(self):
        super().__post_init__()
        if self.engine.compile_cache is not None:
            raise _invalid("compile_cache", "compile_cache holds a decode point's graphs: it serves the prefill and "
                                            "decode roles (trnd serve without --aggregated); --aggregated takes "
                                            "--static alone")


class LocalConfig(PointFront, kw_only=True):
    """`trnd serve`: a local deployment, prefill and decode servers (and a router) on loopback under one
    supervisor (roles/local.py). Its roles' shapes come from the decode point; `secret` (None: a fresh one
    for the children) is shared with stores the operator runs."""
    deploy: Deployment = msgspec.field(default_factory=Deployment)


class DecodeConfig(PointFront, kw_only=True):
    """`trnd decode`: the OpenAI front that owns each request; its prompts' KV comes from prefill peers."""
    prefill: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:8100"])  # host:port of prefill peers
    heartbeat_s: Seconds = 1.0
    peer_timeout_s: Seconds = 3.0  # no frame for this long: the peer is dead
    fence_s: Annotated[float, Meta(ge=0)] = 2.0  # after losing a peer, its target pages rest this long
    prefill_retries: Annotated[int, Meta(ge=0)] = 1
    # A request's KV must have landed this long after it was sent to a prefill peer, or it fails with
    # 504; prefill posts no write for it after that (roles/decode.py, transfer/protocol.PrefillReq).
    handoff_timeout_s: Seconds = 60.0
    # A prompt whose KV would take longer to cross the link to a prefill peer than to compute is computed here
    # (the link's rate and the peer's compute measured on earlier handoffs: transfer/linkrate.py).
    local_when_link_slower: bool = True
    kv_events: KVEventsConfig | None = None  # KV events in vLLM's format (trnd/events); None: off


class PrefillConfig(RoleBase, kw_only=True):
    """`trnd prefill`: a KV factory for decode servers, with an admin port."""
    point: str = "8k"  # as DecodeConfig's: both roles must name the same one
    control_port: Port = 8100  # decode servers connect here (msgspec + HMAC frames)
    pipeline: bool = True  # write each chunk's pages while the next computes; False: all at the end (benchmarks)
    kv_events: KVEventsConfig | None = None  # as DecodeConfig's: prefill's cache (the prefill leg's routes)
    http: AdminPort = msgspec.field(default_factory=AdminPort)

    def __post_init__(self):
        _check_point(self.point)
        super().__post_init__()
        if self.engine.compile_decode:
            raise _invalid("compile_decode", "compile_decode speeds up decode steps: a prefill server runs none")


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`trnd router`: the OpenAI front of a deployment with several decode servers (trnd/router/)."""
    targets: list[str] = msgspec.field(default_factory=list)  # decode servers' HTTP host:port
    target_api_key: str | None = None  # sent to the targets; None: the client's Authorization header as given
    target_api_key_file: str | None = None
    model: str | None = None  # the targets' model dir (or preset): counts prompt tokens exactly; None: bytes
    probe_s: Seconds = 1.0  # /ready probe period per target
    probe_timeout_s: Seconds = 2.0
    fail_after: Positive = 2  # consecutive failed probes that take a target out
    connect_timeout_s: Seconds = 2.0
    request_timeout_s: Seconds = 600.0  # no byte from a target this long: the request ends
    retries: Annotated[int, Meta(ge=0, le=4)] = 1  # a request not yet streaming is retried on another target
    prefix_block_chars: Positive = 256  # prefix affinity: the router hashes prompts in blocks of this many chars
    prefix_entries: Positive = 200_000  # block hashes remembered (LRU; ~141 bytes each: 28 MB at most)
    max_sessions: Positive = 100_000  # session ids remembered per router (LRU, hashed to 32 chars: ~17 MB at most)
    # Counting a prompt's tokens for fit: at most this many characters are tokenized (off the event loop); a
    # longer prompt's count is the tokenized part's, scaled by length (the target checks the exact count).
    max_tokenize_chars: Positive = 262_144
    prefix_load_slack: Annotated[int, Meta(ge=0)] = 4  # a prefix target may carry this many more in flight
    policy: Literal["affinity", "random"] = "affinity"  # affinity: session, prefix, load (router/policy.py)
    log_level: LogLevel = "info"
    http: HTTPConfig = msgspec.field(default_factory=HTTPConfig)

    def __post_init__(self):
        _check_files(self)
        for i, t in enumerate(self.targets):
            host, _, port = t.rpartition(":")
            if not host or not port.isdigit():
                raise _invalid(f"targets[{i}]", f"targets[{i}] = {t!r} is not host:port")

    def resolved_target_key(self) -> str | None:
        return _read("target_api_key", self.target_api_key, self.target_api_key_file)


class StoreConfig(msgspec.Struct, Secret, forbid_unknown_fields=True, kw_only=True):
    """`trnd store`: the L3 remote KV store, one large DRAM region carved into canonical page slots.

    The slot size is not configured: the first client's handshake fixes it (its canonical page bytes)
    until the store restarts; a later client whose canonical page has another size is refused with a
    message naming page_bytes. Several namespaces (models, dtypes) share the slots when their pages
    have that size; their keys never mix."""
    control_port: Port = 8300  # clients connect here (msgspec + HMAC frames, like the roles)
    memory_gb: Annotated[float, Meta(gt=0)] = 4.0  # the DRAM region registered with NIXL
    lease_s: Seconds = 5.0  # a reader's lease pins its slots this long at most
    reserve_s: Seconds = 30.0  # an uncommitted reservation is dropped after this
    max_clients: Positive = 256
    secret: str | None = None  # control-plane shared secret (prefer secret_file)
    secret_file: str | None = None
    log_level: LogLevel = "info"
    transfer_backend: TransferBackend = "ucx"  # the clients' (EngineKnobs.transfer_backend): NIXL pairs like ends only
    http: AdminPort = msgspec.field(default_factory=lambda: AdminPort(admin_port=8301, drain_timeout_s=2.0))

    def __post_init__(self):
        _check_files(self)


# -- flat keys <-> parts ----------------------------------------------------------------------------

def parts_of(cls: type[msgspec.Struct]) -> dict[str, msgspec.Struct]:
    """A role config's parts by field name, each with the role's defaults."""
    return {f.name: f.default_factory() for f in msgspec.structs.fields(cls)
            if f.default_factory is not msgspec.NODEFAULT and isinstance(f.default_factory(), Part)}


def nest(cls: type[msgspec.Struct], data: dict) -> dict:
    """Flat keys (TOML, flags) filed into the parts of `cls` that hold them, on top of the role's defaults for
    that part. A key no part and no top-level field holds is left where it is: msgspec refuses it by name."""
    out = dict(data)
    for name, default in parts_of(cls).items():
        given = out.pop(name, None)
        mine = {k: out.pop(k) for k in default.__struct_fields__ if k in out}
        if given is not None or mine:
            out[name] = {**msgspec.structs.asdict(default), **(given or {}), **mine}
    return out


def keys(cls: type[msgspec.Struct]) -> set[str]:
    """The flat names a role's config takes."""
    parts = parts_of(cls)
    return {*(k for k in cls.__struct_fields__ if k not in parts),
            *(k for p in parts.values() for k in p.__struct_fields__)}


def flat(cfg: msgspec.Struct) -> dict:
    """Every setting of a role's config by its flat name (what TOML and reload speak)."""
    out = {}
    for name in cfg.__struct_fields__:
        value = getattr(cfg, name)
        if isinstance(value, Part):
            out.update({k: getattr(value, k) for k in value.__struct_fields__})
        else:
            out[name] = value
    return out


def replace(cfg: msgspec.Struct, changes: dict) -> msgspec.Struct:
    """`cfg` with flat-named settings changed (reload)."""
    top, parts = {}, {}
    for name in cfg.__struct_fields__:
        value = getattr(cfg, name)
        if isinstance(value, Part):
            mine = {k: v for k, v in changes.items() if k in value.__struct_fields__}
            if mine:
                parts[name] = msgspec.structs.replace(value, **mine)
        elif name in changes:
            top[name] = changes[name]
    return msgspec.structs.replace(cfg, **top, **parts)


_AT = re.compile(r"`\$\.(\w+)\.")
_ENUM = re.compile(r"Invalid enum value (.+) - at `\$\.(\w+)`")


def _flat_error(cls: type[msgspec.Struct], e: msgspec.ValidationError) -> str:
    """msgspec's message with the part dropped from the path (`$.engine.dtype` -> `$.dtype`), and a Literal's
    choices named."""
    msg = _AT.sub("`$.", str(e), count=1) if _AT.search(str(e)) and _AT.search(str(e)).group(1) in parts_of(cls) \
        else str(e)
    m = _ENUM.search(msg)
    if m:
        choices = _choices(cls, m.group(2))
        if choices:
            msg = f"{m.group(2)} = {m.group(1)} is not one of {', '.join(choices)} - at `$.{m.group(2)}`"
    return msg


def _choices(cls: type[msgspec.Struct], field: str) -> list[str]:
    for owner in [cls, *(type(p) for p in parts_of(cls).values())]:
        hint = typing.get_type_hints(owner).get(field)
        if hint is not None and typing.get_origin(hint) is Literal:
            return [str(a) for a in typing.get_args(hint)]
    return []


def read_toml(path: str | Path | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    try:
        return msgspec.toml.decode(p.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def load_config(cls: type[msgspec.Struct], path: str | Path | None, overrides: dict | None = None):
    """Read TOML (if given), apply non-None overrides, file the flat keys into their parts, validate.
    Raises ConfigError (one line)."""
    data = {**read_toml(path), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return convert(cls, data, path)


# A setting the other `trnd serve` mode applies, given to this one: said so instead of "unknown".
_OTHER_MODE = {"ServeConfig": "it does not apply with aggregated = true (one process: a local deployment's setting)",
               "LocalConfig": "it does not apply to a local deployment (its roles' shapes come from the decode point; "
                              "KV events are each role's, trnd prefill/decode); aggregated = true takes it"}
_UNKNOWN = re.compile(r"Object contains unknown field `(\w+)`$")


def convert(cls: type[msgspec.Struct], data: dict, path: str | Path | None = None):
    if isinstance(data.get("log_level"), str):
        data = {**data, "log_level": data["log_level"].lower()}
    try:
        return msgspec.convert(nest(cls, data), cls)
    except msgspec.ValidationError as e:
        msg = _flat_error(cls, e)
        m = _UNKNOWN.match(msg)
        if m and cls.__name__ in _OTHER_MODE and m.group(1) in keys(ServeConfig) | keys(LocalConfig):
            msg = f"{m.group(1)}: {_OTHER_MODE[cls.__name__]} - at `$.{m.group(1)}`"
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{msg}".replace("\n", " ")) from None


def load_serve_config(path: str | Path | None, overrides: dict | None = None) -> ServeConfig | LocalConfig:
    """`trnd serve`: `aggregated` (TOML or --aggregated) picks the config, so a setting only the other mode
    applies (--prefill with --aggregated, --page-size without) is refused, naming it."""
    data = {**read_toml(path), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    aggregated = data.pop("aggregated", False)
    return convert(ServeConfig if aggregated else LocalConfig, data, path)

