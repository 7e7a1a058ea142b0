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

import re
import typing
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from trnd.config.parts import (KEY_FIELDS, AdminPort, APIConfig, ConfigError, Deployment, EngineKnobs, HTTPConfig,
                               KVEventsConfig, LogLevel, Part, PageSize, Port, Positive, RemoteConfig, Seconds, Shapes,
                               SpeculativeConfig, StartupError, TierConfig, TransferBackend, check_files, check_point, engine_conflict,
                               flat, invalid, keys, nest, parse_speculative_config, parts_of, read_key, read_key_file,
                               replace)

__all__ = ["KEY_FIELDS", "AdminPort", "APIConfig", "ConfigError", "DecodeConfig", "Deployment", "EngineKnobs",
           "HTTPConfig", "KVEventsConfig", "LocalConfig", "LogLevel", "PageSize", "Part", "Port", "Positive",
           "PrefillConfig", "RemoteConfig", "RouterConfig", "Seconds", "ServeConfig", "Shapes", "SpeculativeConfig", "StartupError",
           "StoreConfig", "TierConfig", "TransferBackend", "convert", "engine_conflict", "flat", "keys", "load_config",
           "load_serve_config", "parts_of", "read_key_file", "read_toml", "replace"]


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
            raise invalid("secret_file", "no control-plane secret: set secret_file (or secret)")
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
        check_files(self)


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
        check_point(self.point)
        super().__post_init__()
        if self.max_model_len is not None:
            from trnd.points import get_point

            most = get_point(self.point).max_context
            if self.max_model_len > most:  # the engine would serve the larger length the point never promised
                raise invalid("max_model_len", f"max_model_len = {self.max_model_len} is beyond decode point "
                                               f"{self.point!r}'s max_context = {most}: pick a larger point "
                                               "(trnd points), or a smaller max_model_len")


class ServeConfig(FrontBase, kw_only=True):
    """`trnd serve --aggregated`: one process owning model, scheduler and HTTP front."""
    kv_events: KVEventsConfig | None = None  # KV events in vLLM's format (trnd/events); None: off
    shapes: Shapes = msgspec.field(default_factory=Shapes)

    def __post_init__(self):
        super().__post_init__()
        if self.engine.compile_cache is not None:
            raise invalid("compile_cache", "compile_cache holds a decode point's graphs: it serves the prefill and "
                                            "decode roles (trnd serve without --aggregated); --aggregated takes "
                                            "--static alone")


class LocalConfig(PointFront, kw_only=True):
    """`trnd serve`: a local deployment, prefill and decode servers (and a router) on loopback under one
    supervisor (roles/local.py). Its roles' shapes come from the decode point; `secret` (None: a fresh one
    for the children) is shared with stores the operator runs."""
    deploy: Deployment = msgspec.field(default_factory=Deployment)
    # each child publishes its own (ephemeral endpoints: one fixed endpoint cannot serve them all); with
    # several decode servers the local router routes on them
    kv_events: KVEventsConfig | None = None


class DecodeConfig(PointFront, kw_only=True):
    """`trnd decode`: the OpenAI front that owns each request; its prompts' KV comes from prefill peers."""
    prefill: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:8100"])  # host:port of prefill peers
    heartbeat_s: Seconds = 1.0
    # No frame for this long (three missed heartbeats): the peer is lost, whether it died or hangs (SIGSTOP).
    peer_timeout_s: Seconds = 3.0
    # With no prefill peer left (every one lost after the first handshake), prefill every prompt here instead of
    # holding requests for ready_hold_s and answering 503; a peer that comes back is used again at once.
    local_fallback: bool = True
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
        check_point(self.point)
        super().__post_init__()
        if self.engine.compile_decode:
            raise invalid("compile_decode", "compile_decode speeds up decode steps: a prefill server runs none")


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
    # route the prefix rule on the targets' KV events (their real caches: trnd/router/events.py) instead of
    # the texts the router sent; needs `model` (the prompt's tokens) and targets started with kv events on
    kv_events: bool = False
    log_level: LogLevel = "info"
    http: HTTPConfig = msgspec.field(default_factory=HTTPConfig)

    def __post_init__(self):
        check_files(self)
        for i, t in enumerate(self.targets):
            host, _, port = t.rpartition(":")
            if not host or not port.isdigit():
                raise invalid(f"targets[{i}]", f"targets[{i}] = {t!r} is not host:port")

    def resolved_target_key(self) -> str | None:
        return read_key("target_api_key", self.target_api_key, self.target_api_key_file)


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
        check_files(self)


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
               "LocalConfig": "it does not apply to a local deployment (its roles' shapes come from the decode point): "
                              "aggregated = true takes it"}
_UNKNOWN = re.compile(r"Object contains unknown field `(\w+)`$")


def convert(cls: type[msgspec.Struct], data: dict, path: str | Path | None = None):
    if isinstance(data.get("log_level"), str):
        data = {**data, "log_level": data["log_level"].lower()}
    if isinstance(data.get("speculative_config"), str):  # vLLM's JSON text, from the flag or a TOML string
        data = {**data, "speculative_config": parse_speculative_config(data["speculative_config"])}
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

