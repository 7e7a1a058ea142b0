"""The typed parts a role's config is composed of (trnd/config/__init__.py composes them): what the engine
is (EngineKnobs), the tiers below its prefix cache (TierConfig), an HTTP front's port and limits (HTTPConfig)
or an admin port (AdminPort), the OpenAI routes' limits (APIConfig), the aggregated server's step shapes
(Shapes), what only `trnd serve`'s supervisor reads (Deployment); the key files read once, failing closed;
and the flat names TOML, flags and reload speak, each filed into its part (flat, keys, replace).
"""

from __future__ import annotations

import os
import re
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


class RemoteConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The L3 tier's backend: `trnd store`s (their addresses in `store`) or Mooncake Store (store/mooncake.py).
    In TOML it is a table, [remote]; on the command line --remote-config JSON."""
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
    # trnd's: draft only at batch sizes where drafting has measured faster (engine/spec/payoff.py); false:
    # every step drafts, as vLLM's (a seeded sampling request's tokens then depend on nothing but its seed)
    adaptive: bool = True

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


class Part(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A typed part of a role's config; its fields are flat keys in TOML and flags."""


def invalid(field: str, why: str) -> msgspec.ValidationError:
    return msgspec.ValidationError(f"{why} - at `$.{field}`")


def read_key(field: str, value: str | None, file: str | None) -> str | None:
    """A key given inline or (preferred) in a file, e.g. $CREDENTIALS_DIRECTORY/api_key under systemd; an API
    key also from the TRND_API_KEY environment variable (a key kept out of argv, as vLLM's VLLM_API_KEY)."""
    if file:
        return read_key_file(f"{field}_file", file).decode()
    if value is None and field == "api_key":
        return os.environ.get("TRND_API_KEY") or None
    return value


# Keys given inline; each has a `<name>_file` twin. An empty one would turn authentication off (a key of ""
# matches no header, or HMACs with no secret): refused, like an empty or missing file, at start and on reload.
KEY_FIELDS = ("api_key", "target_api_key", "secret")


def read_key_file(field: str, path: str) -> bytes:
    """A key or secret file's content, stripped; fails closed: a file that is missing, unreadable or empty
    is a ConfigError naming the field (at start: exit 78; on reload: the running key is kept). An API key
    must be text (it travels in a header); a control-plane secret may be any bytes. A secret_file under
    $CREDENTIALS_DIRECTORY (the shipped configs: systemd's LoadCredential=) started outside systemd is this
    host's own secret (host_secret_file)."""
    if field == "secret_file" and "CREDENTIALS_DIRECTORY" in path and not os.environ.get("CREDENTIALS_DIRECTORY"):
        path = str(host_secret_file())
    unset = sorted(set(re.findall(r"\$\{?(\w+)", path)) - set(os.environ))
    if unset:
        raise ConfigError(f"{field} = {path!r}: ${unset[0]} is not set; set {field} to a file holding the key, or "
                          f"set {unset[0]} - at `$.{field}`")
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


def host_secret_file() -> Path:
    """The control-plane secret of the roles started on this host outside systemd: one file beside trnd's
    other state ($TRND_CACHE_DIR, else ~/.cache/trnd, as model/maker.py's cache_dir), made 0600 with a random
    secret by the first role that needs it, so a prefill and a decode server started by hand find the same.
    Roles on other hosts need a copy of it (or a secret_file of their own, the same on every host)."""
    path = Path(os.environ.get("TRND_CACHE_DIR") or Path.home() / ".cache" / "trnd") / "control_secret"
    if not path.exists():
        import logging
        import secrets

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)  # whole or not at all: another role never reads it half written
        except FileExistsError:  # another role made it first: theirs
            return path
        finally:
            tmp.unlink()
        logging.getLogger("trnd.config").info("created this host's control-plane secret %s (0600): a prefill and "
                                              "a decode server started here share it", path)
    return path


def check_files(cfg) -> None:
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
                    kv_cache_dtype: str, ep: int = 1) -> tuple[str, str] | None:
    """(field, why) when these engine settings cannot run together, else None: the static path (and a compile
    cache, its graphs) runs one rank on model-dtype pages (engine/static.py); compile_decode
    (engine/compiled.py) one CPU rank on model-dtype pages, not beside the static path. The one place these
    rules live: role configs (EngineKnobs) and the engine (engine/build.py EngineConfig) both ask. The experts
    are split over groups of the role's ranks (trnd/parallel.py): ep divides tp."""
    if tp % ep:
        return "ep", f"ep = {ep} does not divide tp = {tp}: the experts are split over groups of the role's ranks"
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
    # expert parallelism: a MoE model's experts split into `ep` groups of the tp ranks, whole experts each (ep
    # divides tp; 1: every rank a slice of every expert). The KV does not depend on it (trnd/parallel.py)
    ep: Annotated[int, Meta(ge=1, le=64)] = 1
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
    speculative_config: SpeculativeConfig | None = None  # vLLM's --speculative-config (engine/spec/); None: off

    def __post_init__(self):
        bad = engine_conflict(static=self.static, compile_cache=self.compile_cache, compile_decode=self.compile_decode,
                              tp=self.tp, backend=self.backend, kv_cache_dtype=self.kv_cache_dtype, ep=self.ep)
        if bad is not None:
            raise invalid(*bad)
        lock = self.core_lock
        if lock is not None and not os.path.isdir(os.path.dirname(os.path.abspath(lock))):
            raise invalid("core_lock", f"core_lock = {lock!r}: its directory does not exist")


class TierConfig(Part):
    """The tiers below the prefix cache: L2 host DRAM, L3 remote stores or Mooncake Store (trnd/cache/tiers.py)."""
    host_cache_gb: Annotated[float, Meta(ge=0)] = 0.0  # L2: evicted prefix pages kept in host DRAM; 0 = off
    host_policy: Literal["write-back", "write-through"] = "write-back"  # on eviction, or on finish
    node_host_memory_gb: Annotated[float, Meta(gt=0)] | None = None  # budget shared by all trnd processes
    store: list[str] = msgspec.field(default_factory=list)  # L3 remote KV stores, host:port; [] = off
    store_on_finish: bool = True  # write finished requests' full pages to L3 (sessions across roles)
    store_deadline_s: Seconds = 1.0  # a slower store is a cache miss
    remote: RemoteConfig | None = None  # the L3 backend; None: the `trnd store`s at `store`


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
        return read_key("api_key", self.api_key, self.api_key_file)


class AdminPort(Part):
    """The HTTP port of a role with no OpenAI front (prefill, store): probes, /metrics, /admin."""
    host: str = "127.0.0.1"  # every listener of the role binds here (loopback by default)
    admin_port: Port = 8101
    api_key: str | None = None  # for /admin/* on the admin port
    api_key_file: str | None = None
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0  # SIGTERM: in-flight work may finish this long

    def resolved_api_key(self) -> str | None:
        return read_key("api_key", self.api_key, self.api_key_file)


class APIConfig(Part):
    """The OpenAI routes (serve, decode): admission and per-request limits, how replies are parsed."""
    served_model_name: str | None = None
    max_requests: Positive = 1024  # in flight; beyond this new requests get 503 + Retry-After
    max_n: Annotated[int, Meta(ge=1, le=128)] = 16
    max_stop: Positive = 4  # stop sequences per request (OpenAI's limit)
    max_stop_chars: Positive = 1024  # their total length
    max_logit_bias: Positive = 300  # logit_bias entries per request (each is added to the logits every step)
    max_stop_token_ids: Positive = 128  # stop_token_ids per request (each new token is looked up among them)
    # A request's grammar (response_format, structured_outputs, tool schemas; api/structured.py): its text, a
    # schema's JSON nesting, and the time its compile may take on a worker thread. Past each: 400 naming it.
    max_grammar_chars: Positive = 262_144
    max_grammar_depth: Positive = 64
    grammar_compile_s: Seconds = 10.0
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


def check_point(point: str) -> None:
    from trnd.points import load_points

    try:
        known = load_points()
    except ValueError as e:  # a broken points file: its own message names the file and field
        raise invalid("point", str(e)) from None
    if point not in known:
        raise invalid("point", f"point = {point!r} is not a known decode point (known: {', '.join(sorted(known))})")


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
