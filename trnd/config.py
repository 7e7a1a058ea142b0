"""Typed role configuration: one msgspec Struct per role, loaded from TOML, validated once at start.

Errors are one line naming the file and the field (msgspec's `- at $.field` path), so a bad config
exits with EX_CONFIG and a message an operator can act on. Command-line flags override file values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Port = Annotated[int, Meta(ge=0, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
PageSize = Annotated[int, Meta(ge=1, le=4096)]
TransferBackend = Literal["ucx", "libfabric"]


class ConfigError(ValueError):
    """A bad config file or flag value; the message is one line naming the field."""


class StartupError(RuntimeError):
    """A role that must not start (pool too small for the point, bad layout): one line, exit EX_CONFIG."""


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's --kv-events-config (vllm/config/kv_events.py), key for key: the engine's prefix cache publishes
    what it stores and drops (trnd/events). The same JSON works on `--kv-events-config` here and on vLLM."""
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


class RemoteConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The L3 tier's backend: `trnd store`s (their addresses in `store`) or Mooncake Store (store/mooncake.py)."""
    backend: Literal["trnd", "mooncake"] = "trnd"
    master: str = "127.0.0.1:50051"  # mooncake_master's --rpc_address:--rpc_port
    metadata_server: str = "http://127.0.0.1:8080/metadata"  # its HTTP metadata server, or P2PHANDSHAKE, etcd://...
    protocol: Literal["tcp", "rdma", "efa"] = "tcp"
    device: str = ""  # RDMA/EFA devices ("" for tcp)
    local_hostname: str = "127.0.0.1"  # how the other clients reach this one's segment
    # memory this process lends to the store's pool; 0: none, the pages live on store nodes (`mooncake_client`),
    # so they outlive this role (a role's own segment, and the pages in it, go when it stops)
    segment_gb: Annotated[float, Meta(ge=0)] = 0.0
    buffer_gb: Annotated[float, Meta(gt=0)] = 0.125  # this client's staging buffer


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's --speculative-config (engine/spec/): the same JSON on `trnd serve`, `trnd decode` and `trnd prefill`,
    or a [speculative_config] table in a role's TOML. Part of the decode-point contract: a prefill peer and a
    decode server with different ones are refused at the handshake, naming the field."""
    method: Literal["ngram", "draft", "draft_model", "mtp"]  # draft_model: vLLM's name for draft
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=16)]  # K: tokens drafted per step and verified in one forward
    model: str | None = None  # the draft checkpoint (method draft): a directory or preset, the target's tokenizer
    prompt_lookup_min: Annotated[int, Meta(ge=1)] | None = None  # ngram: shortest suffix looked up (default: max's, or 5)
    prompt_lookup_max: Annotated[int, Meta(ge=1)] | None = None  # ngram: longest suffix looked up (default: min's, or 5)
    disable_by_batch_size: Annotated[int, Meta(ge=1)] | None = None  # no drafting while this many requests run

    def __post_init__(self):
        if self.method == "draft_model":
            self.method = "draft"
        if self.method == "ngram":  # vLLM's defaults: both 5, or the one given for both
            self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max or 5
            self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise msgspec.ValidationError(
                    f"speculative_config.prompt_lookup_min = {self.prompt_lookup_min} is above prompt_lookup_max = "
                    f"{self.prompt_lookup_max} - at `$.speculative_config.prompt_lookup_min`")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise msgspec.ValidationError(f"speculative_config.prompt_lookup_min/max apply to method 'ngram', not "
                                          f"{self.method!r} - at `$.speculative_config.method`")
        if self.method == "draft" and not self.model:
            raise msgspec.ValidationError("speculative_config.method = 'draft' needs model (the draft checkpoint's "
                                          "directory or a preset) - at `$.speculative_config.model`")
        if self.method in ("ngram", "mtp") and self.model:
            raise msgspec.ValidationError(f"speculative_config.model is the draft checkpoint of method 'draft'; "
                                          f"{self.method!r} takes none - at `$.speculative_config.model`")

    def contract(self) -> dict:
        """What a prefill peer and a decode server must agree on (the handshake compares it)."""
        return {f: getattr(self, f) for f in ("method", "num_speculative_tokens", "model", "prompt_lookup_min",
                                              "prompt_lookup_max")}


def parse_speculative_config(text: str) -> dict:
    """--speculative-config's JSON text -> the table load_config validates (ConfigError: one line)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"speculative_config: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config: expected a JSON object like "
                          f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}', got {text!r}")
    return value


class ServeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The aggregated server (`trnd serve`): one process owning model, scheduler and HTTP front."""
    model: str | None = None  # None: the embedded default (a tiny model made on first use)
    host: str = "127.0.0.1"
    port: Port = 8000
    api_key: str | None = None  # None: open; else required on /v1/* and /admin/*
    api_key_file: str | None = None  # e.g. $CREDENTIALS_DIRECTORY/api_key under systemd
    dtype: str = "auto"  # auto: the checkpoint's, or float32 on a CPU without native bf16 (backends/cpu.py)
    kv_cache_dtype: str = "auto"  # auto: KV in the compute dtype; fp8_e4m3 | fp8_e5m2: fp8 pages + scales
    backend: str = "cpu"
    tp: Annotated[int, Meta(ge=1, le=64)] = 1  # tensor-parallel ranks (processes)
    page_size: PageSize = 16
    kv_memory_gb: Annotated[float, Meta(gt=0)] = 1.0
    num_pages: Positive | None = None
    max_model_len: Positive | None = None
    max_batch: Positive = 32
    token_budget: Positive = 512
    chunk_size: Positive = 512
    prefix_cache: bool = True
    max_requests: Positive = 1024  # in flight; beyond this new requests get 503 + Retry-After
    max_body_bytes: Positive = 4 * 2**20
    max_n: Annotated[int, Meta(ge=1, le=128)] = 16
    max_stop: Positive = 4  # stop sequences per request (OpenAI's limit)
    max_stop_chars: Positive = 1024  # their total length
    max_logit_bias: Positive = 300  # logit_bias entries per request (each is added to the logits every step)
    max_stop_token_ids: Positive = 128  # stop_token_ids per request (each new token is looked up among them)
    # A request's grammar (response_format, structured_outputs, tool schemas; api/structured.py): its text, a
    # schema's JSON nesting, and the time its compile may take on a worker thread. Past each: 400 naming it.
    max_grammar_chars: Positive = 262_144
    max_grammar_depth: Positive = 64
    grammar_compile_s: Annotated[float, Meta(gt=0)] = 10.0
    max_job_tokens: Positive | None = None  # n x (prompt + max_tokens) of one request; None: no cap
    max_header_bytes: Positive = 64 * 2**10  # request line + headers; beyond: 431
    header_timeout_s: Annotated[float, Meta(gt=0)] = 10.0  # the headers must be in by then, or the connection is closed
    served_model_name: str | None = None
    threads: Positive | None = None
    log_level: str = "info"
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0
    kv_events: KVEventsConfig | None = None  # KV events in vLLM's format (trnd/events); None: off
    remote: RemoteConfig | None = None  # the L3 backend; None: `trnd store`s at `store`
    # An OpenAI request that arrives before the server can serve it (starting, or a decode server with no
    # prefill peer) is held this long, then answered 503 with Retry-After.
    ready_hold_s: Annotated[float, Meta(ge=0)] = 30.0
    host_cache_gb: Annotated[float, Meta(ge=0)] = 0.0  # L2: evicted prefix pages kept in host DRAM; 0 = off
    host_policy: str = "write-back"  # write-back (on eviction) or write-through (on finish)
    node_host_memory_gb: Annotated[float, Meta(gt=0)] | None = None  # budget shared by all trnd processes
    store: list[str] = msgspec.field(default_factory=list)  # L3 remote KV stores, host:port; [] = off
    store_on_finish: bool = True  # write finished requests' full pages to L3 (sessions across roles)
    store_deadline_s: Annotated[float, Meta(gt=0)] = 1.0  # a slower store is a cache miss
    secret: str | None = None  # control-plane secret (prefill peers, stores); prefer secret_file
    secret_file: str | None = None
    aggregated: bool = False  # serve only: one process instead of a local prefill + decode deployment
    point: str = "8k"  # decode point of the local deployment's roles
    # Local deployment: fixed ports for its children (None: a free port each, picked at start and printed).
    prefill_control_port: Port | None = None  # the first prefill server's; the i-th takes port + i
    prefill_admin_port: Port | None = None  # likewise (its /health, /ready, /metrics, /admin)
    # Local deployment: its roles take turns on the cores, one forward pass at a time (engine/corelock.py).
    share_cores: bool = True
    decode_port: Port | None = None  # with num_decode > 1: the first decode server's API port (the router has `port`)
    num_prefill: Annotated[int, Meta(ge=1, le=16)] = 1  # local deployment: prefill servers (--prefill N)
    num_decode: Annotated[int, Meta(ge=1, le=16)] = 1  # decode servers (--decode M); > 1: `trnd router` on port
    router_policy: str = "affinity"  # the local router's policy (affinity; random for benchmarks)
    # How this model writes tool calls and reasoning (docs/API.md); "none" turns a parser off.
    tool_call_parser: str = "hermes"  # hermes (Qwen2.5/Qwen3, the default model) | llama3_json | none
    reasoning_parser: str = "none"  # qwen3 | deepseek_r1 | none
    static: bool = False  # every step padded to the point's buckets, one compiled graph each (engine/static.py)
    compile_cache: str | None = None  # a `trnd compile` output dir: its graphs are loaded, none compiled (implies static)
    compile_decode: bool = False  # CPU: decode-only steps as one inductor graph, compiled at start (engine/compiled.py)
    # A file every role on this node's cores locks around each forward pass, so they take turns instead of
    # oversubscribing the cores (engine/corelock.py); `trnd serve` sets one for its roles. None: off.
    core_lock: str | None = None
    # Decode role (conditional disaggregation, as Dynamo's max_local_prefill_length): a new prompt with at
    # most this many tokens past this server's own prefix-cache hit is prefilled here, mixed into the decode
    # steps, instead of handed to a prefill peer (roles/decode.py). 0: every prompt to a peer. None (auto):
    # roles/decode.py's LOCAL_PREFILL_SHARED_CORES where the roles take turns on this node's cores (core_lock
    # set), else 0.
    local_prefill_tokens: Annotated[int, Meta(ge=0)] | None = None
    # The NIXL backend that moves KV pages between roles and to L3 stores: "ucx", or "libfabric" (EFA's
    # path; its tcp provider elsewhere). Both ends must name the same one (the handshake refuses a
    # mismatch); transfer/backends.py says what libfabric needs.
    transfer_backend: TransferBackend = "ucx"
    speculative_config: SpeculativeConfig | None = None  # vLLM's --speculative-config (engine/spec/); None: off

    def __post_init__(self):
        _check_common(self)

    def resolved_secret_optional(self) -> bytes | None:
        if self.secret_file:
            return read_key_file("secret_file", self.secret_file)
        return self.secret.encode() if self.secret else None

    def resolved_api_key(self) -> str | None:
        if self.api_key_file:
            return read_key_file("api_key_file", self.api_key_file).decode()
        return self.api_key


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
    """Every `*_file` field read now (one line naming it, never a traceback later), every key non-empty."""
    for field in cfg.__struct_fields__:
        value = getattr(cfg, field)
        if field.endswith("_file") and value is not None:
            try:
                read_key_file(field, value)
            except ConfigError as e:
                raise msgspec.ValidationError(str(e)) from None
        elif field in KEY_FIELDS and value is not None and not value.strip():
            raise msgspec.ValidationError(f"{field} is empty: unset it to run without a key - at `$.{field}`")


def _check_common(cfg) -> None:
    """Choices msgspec's type system does not express, named like msgspec names its errors."""
    choices = {"log_level": ("debug", "info", "warning", "error"), "dtype": ("auto", "bfloat16", "float32", "float16"),
               "kv_cache_dtype": ("auto", "fp8_e4m3", "fp8_e5m2"),
               "host_policy": ("write-back", "write-through"), "backend": ("cpu", "cuda", "neuron"),
               "router_policy": ("affinity", "random"), "policy": ("affinity", "random"),
               "tool_call_parser": ("hermes", "llama3_json", "none"), "reasoning_parser": ("qwen3", "deepseek_r1", "none")}
    point = getattr(cfg, "point", None)
    if point is not None:
        from trnd.points import load_points

        try:
            known = load_points()
        except ValueError as e:  # a broken points file: its own message names the file and field
            raise msgspec.ValidationError(f"{e} - at `$.point`") from None
        if point not in known:
            raise msgspec.ValidationError(f"point = {point!r} is not a known decode point (known: "
                                          f"{', '.join(sorted(known))}) - at `$.point`")
    _check_static(cfg)
    _check_files(cfg)
    lock = getattr(cfg, "core_lock", None)
    if lock is not None and not os.path.isdir(os.path.dirname(os.path.abspath(lock))):
        raise msgspec.ValidationError(f"core_lock = {lock!r}: its directory does not exist - at `$.core_lock`")
    for field, allowed in choices.items():
        if field not in cfg.__struct_fields__:  # each role's config has its own subset
            continue
        value = getattr(cfg, field)
        if field == "log_level" and isinstance(value, str):
            value = value.lower()
        if value not in allowed:
            shown = ", ".join(str(a) for a in allowed if a is not None)
            raise msgspec.ValidationError(f"{field} = {value!r} is not one of {shown} - at `$.{field}`")


def _check_static(cfg) -> None:
    """The static path runs one rank on model-dtype pages (engine/static.py); a compile cache is its graphs.
    compile_decode (engine/compiled.py) likewise, on the CPU, and not beside the static path."""
    if "static" not in cfg.__struct_fields__:
        return
    static = cfg.static or cfg.compile_cache is not None
    field = "static" if cfg.static else "compile_cache"
    if static and cfg.tp > 1:
        raise msgspec.ValidationError(f"{field} runs one rank: tp = {cfg.tp} must be 1 - at `$.{field}`")
    if static and cfg.kv_cache_dtype != "auto":
        raise msgspec.ValidationError(f"{field} keeps KV in the model dtype: kv_cache_dtype = {cfg.kv_cache_dtype!r} "
                                      f"runs on the eager path - at `$.{field}`")
    why = compile_decode_conflict(cfg.compile_decode, cfg.backend, cfg.tp, static, cfg.kv_cache_dtype)
    if why:
        raise msgspec.ValidationError(f"{why} - at `$.compile_decode`")


def compile_decode_conflict(on: bool, backend: str, tp: int, static: bool, kv_cache_dtype: str) -> str | None:
    """Why compile_decode (engine/compiled.py: one CPU rank, model-dtype pages, not beside the static path)
    cannot run with these settings; None when it can. Role configs and EngineConfig both ask."""
    if not on:
        return None
    for bad, why in ((backend != "cpu", f"backend = {backend!r} (it compiles for the CPU)"),
                     (tp > 1, f"tp = {tp} (it runs one rank)"),
                     (static, "static (the static path compiles every step already)"),
                     (kv_cache_dtype != "auto", f"kv_cache_dtype = {kv_cache_dtype!r} (it reads model-dtype pages)")):
        if bad:
            return f"compile_decode does not go with {why}"
    return None


def load_config(cls: type[msgspec.Struct], path: str | Path | None, overrides: dict | None = None):
    """Read TOML (if given), apply non-None overrides, validate. Raises ConfigError (one line)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            data = msgspec.toml.decode(p.read_bytes())
        except FileNotFoundError:
            raise ConfigError(f"{p}: config file not found") from None
        except msgspec.DecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    if isinstance(data.get("speculative_config"), str):  # vLLM's JSON text, from the flag or a TOML string
        data["speculative_config"] = parse_speculative_config(data["speculative_config"])
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as e:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{e}".replace("\n", " ")) from None


class RoleConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields every disaggregated role has. The decode point fixes page size, max context, max batch
    and prefill chunk: both roles must name the same one."""
    model: str | None = None
    point: str = "8k"
    dtype: str = "auto"  # auto: the checkpoint's, or float32 on a CPU without native bf16 (backends/cpu.py)
    kv_cache_dtype: str = "auto"  # auto: KV in the compute dtype; fp8_e4m3 | fp8_e5m2: fp8 pages + scales
    backend: str = "cpu"
    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    kv_memory_gb: Annotated[float, Meta(gt=0)] = 1.0
    prefix_cache: bool = True
    threads: Positive | None = None
    secret: str | None = None  # control-plane shared secret (prefer secret_file)
    secret_file: str | None = None  # e.g. ${CREDENTIALS_DIRECTORY}/control_secret under systemd
    log_level: str = "info"
    host_cache_gb: Annotated[float, Meta(ge=0)] = 0.0
    host_policy: str = "write-back"
    node_host_memory_gb: Annotated[float, Meta(gt=0)] | None = None
    store: list[str] = msgspec.field(default_factory=list)  # L3 remote KV stores, host:port; [] = off
    store_on_finish: bool = True  # write finished requests' full pages to L3 (sessions across roles)
    store_deadline_s: Annotated[float, Meta(gt=0)] = 1.0  # a slower store is a cache miss
    static: bool = False  # every step padded to the point's buckets, one compiled graph each (engine/static.py)
    compile_cache: str | None = None  # a `trnd compile` output dir: its graphs are loaded, none compiled (implies static)
    compile_decode: bool = False  # as ServeConfig.compile_decode
    core_lock: str | None = None  # as ServeConfig.core_lock
    transfer_backend: TransferBackend = "ucx"  # as ServeConfig.transfer_backend
    remote: RemoteConfig | None = None  # as ServeConfig.remote
    speculative_config: SpeculativeConfig | None = None  # as ServeConfig.speculative_config (the contract's)

    def __post_init__(self):
        _check_common(self)

    def resolved_secret(self) -> bytes:
        if self.secret_file:
            return read_key_file("secret_file", self.secret_file)
        if self.secret:
            return self.secret.encode()
        raise msgspec.ValidationError("no control-plane secret: set secret_file (or secret) - at `$.secret_file`")


class PrefillConfig(RoleConfig, kw_only=True):
    host: str = "127.0.0.1"
    api_key: str | None = None  # for /admin/* on the admin port
    api_key_file: str | None = None
    control_port: Port = 8100  # decode servers connect here (msgspec + HMAC frames)
    admin_port: Port = 8101  # /health, /ready, /metrics, /admin/state
    pipeline: bool = True  # write each chunk's pages while the next computes; False: all at the end (benchmarks)
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0  # SIGTERM: in-flight prefills may finish this long
    kv_events: KVEventsConfig | None = None  # as ServeConfig.kv_events: prefill's cache (the prefill leg's routes)

    resolved_api_key = ServeConfig.resolved_api_key


class DecodeConfig(ServeConfig, kw_only=True):
    prefill: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:8100"])  # host:port of prefill peers
    heartbeat_s: Annotated[float, Meta(gt=0)] = 1.0
    # No frame for this long (three missed heartbeats): the peer is lost, whether it died or hangs (SIGSTOP).
    peer_timeout_s: Annotated[float, Meta(gt=0)] = 3.0
    # With no prefill peer left (every one lost after the first handshake), prefill every prompt here instead of
    # holding requests for ready_hold_s and answering 503; a peer that comes back is used again at once.
    local_fallback: bool = True
    fence_s: Annotated[float, Meta(ge=0)] = 2.0  # after losing a peer, its target pages rest this long
    prefill_retries: Annotated[int, Meta(ge=0)] = 1
    # A request's KV must have landed this long after it was sent to a prefill peer, or it fails with
    # 504; prefill posts no write for it after that (roles/decode.py, transfer/protocol.PrefillReq).
    handoff_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    # A prompt whose KV would take longer to cross the link to a prefill peer than to compute is computed here
    # (the link's rate and the peer's compute measured on earlier handoffs: transfer/linkrate.py).
    local_when_link_slower: bool = True

    resolved_secret = RoleConfig.resolved_secret


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`trnd router`: the OpenAI front of a deployment with several decode servers (trnd/router/)."""
    host: str = "127.0.0.1"
    port: Port = 8000
    targets: list[str] = msgspec.field(default_factory=list)  # decode servers' HTTP host:port
    api_key: str | None = None  # required of the router's clients on /v1 and /admin
    api_key_file: str | None = None
    target_api_key: str | None = None  # sent to the targets; None: the client's Authorization header as given
    target_api_key_file: str | None = None
    model: str | None = None  # the targets' model dir (or preset): counts prompt tokens exactly; None: bytes
    probe_s: Annotated[float, Meta(gt=0)] = 1.0  # /ready probe period per target
    probe_timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    fail_after: Positive = 2  # consecutive failed probes that take a target out
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 2.0
    request_timeout_s: Annotated[float, Meta(gt=0)] = 600.0  # no byte from a target this long: the request ends
    retries: Annotated[int, Meta(ge=0, le=4)] = 1  # a request not yet streaming is retried on another target
    prefix_block_chars: Positive = 256  # prefix affinity: the router hashes prompts in blocks of this many chars
    prefix_entries: Positive = 200_000  # block hashes remembered (LRU; ~141 bytes each: 28 MB at most)
    max_sessions: Positive = 100_000  # session ids remembered per router (LRU, hashed to 32 chars: ~17 MB at most)
    # Counting a prompt's tokens for fit: at most this many characters are tokenized (off the event loop); a
    # longer prompt's count is the tokenized part's, scaled by length (the target checks the exact count).
    max_tokenize_chars: Positive = 262_144
    prefix_load_slack: Annotated[int, Meta(ge=0)] = 4  # a prefix target may carry this many more in flight
    policy: str = "affinity"  # affinity: session, prefix, load (trnd/router/policy.py); random: benchmarks
    # route the prefix rule on the targets' KV events (their real caches: trnd/router/events.py) instead of
    # the texts the router sent; needs `model` (the prompt's tokens) and targets started with kv events on
    kv_events: bool = False
    ready_hold_s: Annotated[float, Meta(ge=0)] = 30.0  # no healthy target yet: a request waits this long, then 503
    max_body_bytes: Positive = 4 * 2**20
    log_level: str = "info"
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0

    def __post_init__(self):
        _check_common(self)
        for i, t in enumerate(self.targets):
            host, _, port = t.rpartition(":")
            if not host or not port.isdigit():
                raise msgspec.ValidationError(f"targets[{i}] = {t!r} is not host:port - at `$.targets[{i}]`")

    resolved_api_key = ServeConfig.resolved_api_key

    def resolved_target_key(self) -> str | None:
        if self.target_api_key_file:
            return read_key_file("target_api_key_file", self.target_api_key_file).decode()
        return self.target_api_key


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`trnd store`: the L3 remote KV store, one large DRAM region carved into canonical page slots.

    The slot size is not configured: the first client's handshake fixes it (its canonical page bytes)
    until the store restarts; a later client whose canonical page has another size is refused with a
    message naming page_bytes. Several namespaces (models, dtypes) share the slots when their pages
    have that size; their keys never mix."""
    host: str = "127.0.0.1"
    control_port: Port = 8300  # clients connect here (msgspec + HMAC frames, like the roles)
    admin_port: Port = 8301  # /health, /ready, /admin/state
    memory_gb: Annotated[float, Meta(gt=0)] = 4.0  # the DRAM region registered with NIXL
    lease_s: Annotated[float, Meta(gt=0)] = 5.0  # a reader's lease pins its slots this long at most
    reserve_s: Annotated[float, Meta(gt=0)] = 30.0  # an uncommitted reservation is dropped after this
    max_clients: Positive = 256
    secret: str | None = None  # control-plane shared secret (prefer secret_file)
    secret_file: str | None = None
    api_key: str | None = None  # for /admin/* on the admin port
    api_key_file: str | None = None
    log_level: str = "info"
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 2.0
    transfer_backend: TransferBackend = "ucx"  # the clients' (ServeConfig.transfer_backend): NIXL pairs like ends only

    def __post_init__(self):
        _check_common(self)

    resolved_secret = RoleConfig.resolved_secret
    resolved_api_key = ServeConfig.resolved_api_key
