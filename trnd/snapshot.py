"""The /admin/state schema: what every role says about itself, built here and read here.

engine/state.py, roles/decode.py, roles/prefill.py and store/server.py build these Structs; api/app.py
encodes them (fields a role does not have are left out); `trnd top` (top/model.py) decodes them and
/metrics (api/metrics.py) reads them. Every field has a default, so a console reads an older or a
newer server's state: missing fields take the default, unknown ones are ignored. A State leaves out
what its role does not have (None); the parts below always carry every field.
"""

from __future__ import annotations

import msgspec


class _S(msgspec.Struct, kw_only=True):
    pass


# -- the engine -----------------------------------------------------------------------------------------

class Request(_S):
    id: str = "?"
    session_id: str | None = None
    state: str = "waiting"  # waiting | loading_kv (an L2 copy or an L3 read) | waiting_for_kv (a prefill peer)
    #                         | prefilling | decoding
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    max_tokens: int = 0
    pages: int = 0
    tokens_per_s: float | None = None
    age_s: float = 0.0
    preemptions: int = 0


class Pages(_S):
    total: int = 0
    free: int = 0
    in_use: int = 0  # held by a request, a tier transfer or a role (a write in flight, a quarantine)
    cached: int = 0  # held by the prefix cache only (evictable)
    page_size: int | None = None
    page_bytes: int | None = None  # one page on one rank, as stored (fp8: values + scales)
    kv_dtype: str | None = None  # the pool's element type (float8_e4m3fn, bfloat16, ...)
    token_capacity: int | None = None  # total * page_size: what the pool holds at its page_bytes
    kind: str | None = None  # the pool kind (model/config.py PoolKind): "gqa" (K|V per KV head), "latent" (MLA)


class Radix(_S):
    cached_pages: int = 0
    evictable_pages: int = 0
    protected_pages: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    hit_rate: float = 0.0
    evicted_pages: int = 0
    nodes: int = 0
    salts: int = 0  # cache salts (tenants: http/tenant.py) with pages in this cache, beside the shared space


class KVEvents(_S):
    """Where this engine publishes its KV events (trnd/events; vLLM's format) and how far it got."""
    endpoint: str = ""
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 0
    hash_algo: str = ""
    seq: int = 0  # batches published
    dropped: int = 0  # batches a full queue lost
    replays: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0


class LoadMs(_S):
    n: int = 0
    p50: float | None = None
    max: float | None = None


class HostTier(_S):
    """L2: host DRAM slots holding evicted (or written-through) pages."""
    slots: int = 0
    used: int = 0
    free: int = 0
    page_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    stored: int = 0
    loaded: int = 0
    evicted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    load_ms: LoadMs | None = None
    pinned_slots: int = 0
    saves_in_flight: int = 0


class StoreLink(_S):
    """One L3 store as its client sees it."""
    addr: str = "?"
    admin: str | None = None  # the store's admin URL (its /admin/state), as Peer.admin
    healthy: bool = False
    connected: bool = False
    store_id: str | None = None
    slots: int | None = None
    error: str | None = None
    refused: str | None = None
    connects: int = 0
    restarts: int = 0
    skipped_s: float = 0.0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    pages_loaded: int = 0
    bytes_in: int = 0
    pages_stored: int = 0
    pages_present: int = 0
    bytes_out: int = 0
    timeouts: int = 0
    errors: int = 0
    corrupt: int = 0


class RemoteTier(_S):
    """L3: the stores this role reads and writes (their fill only they know: see a store's own state)."""
    stores: list[StoreLink] = []
    lookups: int = 0
    reads: int = 0
    writes: int = 0
    timeouts: int = 0
    failures: int = 0
    in_flight: int = 0
    fenced_pages: int = 0
    load_ms: LoadMs | None = None
    writes_in_flight: int = 0
    pages_written: int = 0


class Tiers(_S):
    policy: str | None = None
    host: HostTier | None = None
    remote: RemoteTier | None = None


class Stats(_S):
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    last_step_s: float = 0.0
    last_step_tokens: int = 0
    core_lock_wait_s: float = 0.0
    started: float = 0.0


class Rank(_S):
    rank: int = 0
    pid: int | None = None
    alive: bool = True


class Layout(_S):
    tp: int | None = None
    ep: int | None = None  # expert-parallel groups of the tp ranks (trnd/parallel.py); 1: every rank every expert
    expert_bytes: int | None = None  # rank 0's expert weights as held (1/ep of the experts, 1/(tp/ep) of each)
    kv_heads_per_rank: int | None = None
    ranks: list[Rank] = []


class Limits(_S):
    max_model_len: int | None = None
    max_batch: int | None = None
    token_budget: int | None = None
    chunk_size: int | None = None


class Capacity(_S):
    """What a disaggregated role's pool holds under its decode point (trnd/points.py: capacity)."""
    kv_bytes_per_token: int | None = None
    pages: int | None = None
    tokens: int | None = None
    full_length_sequences: float | None = None
    max_batch: int | None = None
    tokens_per_sequence_at_full_batch: int | None = None


class Static(_S):
    """The static, bucketed path (engine/static.py): the point's buckets, and what torch compiled or loaded
    for them in this process (its own counters: inductor's FX graph cache hits and misses)."""
    point: str | None = None
    compiler: str | None = None
    decode_buckets: list[int] = []
    prefill_buckets: list[int] = []
    widths: list[int] = []  # page-table widths (pages), powers of two up to max_context / page_size
    graphs: int = 0  # every bucket of the point
    used: int = 0  # buckets run (or warmed) so far
    loaded: int = 0  # graphs loaded from the compile cache
    compiled: int = 0  # graphs compiled in this process
    compile_cache: str | None = None  # the `trnd compile` dir this role loaded


class Integrity(_S):
    """The page-pool check the engine loop runs whenever it goes idle (engine/state.py)."""
    ok: bool = True
    error: str | None = None  # the first broken invariant of the last failed check
    checks: int = 0
    failures: int = 0
    at: float = 0.0  # wall-clock time of the last check
    ms: float = 0.0
    pages: Pages | None = None  # free, cached, in_use, total as the check counted them


class Kernels(_S):
    """An engine role's compiled CPU kernels (trnd_kernels/cpu): loaded, or why it runs the torch ops."""
    loaded: bool = False
    build: str | None = None  # trnd_avx2 | trnd_avx512: the build for this CPU
    kind: str = ""  # loaded | off | unsupported | missing | stale | broken | other_torch
    why: str = ""
    slow_path: bool = False  # the CPU could run them and nobody turned them off: about half the speed


class Spec(_S):
    """Speculative decoding (engine/spec/): vLLM's spec_decode counters since start, and what they mean."""
    method: str = ""  # ngram | draft | mtp
    num_speculative_tokens: int = 0  # K
    num_drafts: int = 0  # drafts verified
    num_draft_tokens: int = 0  # tokens drafted
    num_accepted_tokens: int = 0  # of those, kept
    accepted_per_pos: list[int] = []  # kept, by position in the draft (0 .. K-1)
    acceptance: float = 0.0  # num_accepted_tokens / num_draft_tokens
    mean_accepted_length: float = 0.0  # tokens a verifying step emits per request: 1 + accepted per draft
    backing_off: int = 0  # requests not drafting now: their last drafts kept nothing (it does not pay)
    plain_steps: int = 0  # decode steps the payoff measure ran without drafts (slower there, or re-measuring)
    payoff: dict[int, list[float | None]] = {}  # per batch size: [output tok/s drafting, without] (adaptive)
    draft_pages: int | None = None  # the draft model's pool: pages held, of draft_pages_total
    draft_pages_total: int | None = None


# -- disaggregated roles --------------------------------------------------------------------------------

class InFlight(_S):
    rid: str = "?"
    peer: str | int = "?"  # decode: the prefill peer's address; prefill: the decode peer's id
    notifs: int | None = None  # decode: chunk writes landed
    fenced: bool = False  # decode: aborted, waiting for the peer's word
    xfers: int | None = None  # prefill: writes in flight
    sent_pages: int | None = None  # prefill
    age_s: float = 0.0


class Transfers(_S):
    """KV handoff counters. decode: handoffs .. kv_pages_received; prefill: requests .. unauthenticated."""
    in_flight: list[InFlight] = []
    quarantined_pages: int | None = None
    handoffs: int | None = None
    retried: int | None = None
    requests: int | None = None
    xfers: int | None = None
    bytes: int | None = None
    descriptors: int | None = None  # prefill: NIXL descriptors posted (pages coalesced into runs, transfer/plan.py)
    digest_failures: int | None = None  # decode: handoffs whose landed bytes failed the digest (transfer/digest.py)
    local_for_link: int | None = None  # decode: prompts prefilled here because the link was slower than recompute
    prefill_by_prefix: int | None = None  # decode: handoffs to the peer a router found holding the prefix
    post_ms: float | None = None
    xfer_ms: float | None = None
    failed: int | None = None
    fenced: int | None = None
    timed_out: int | None = None  # decode: handoffs past handoff_timeout_s (504)
    kv_pages_received: int | None = None
    kv_bytes_received: int | None = None  # decode: kv_pages_received x page_bytes
    aborted: int | None = None
    local_prefills: int | None = None  # decode: prompts prefilled here (local_prefill_tokens), not handed off
    local_fallbacks: int | None = None  # decode: prompts prefilled here because no prefill peer was left
    refused: int | None = None
    unauthenticated: int | None = None


class Peer(_S):
    kind: str = ""  # "prefill" (a decode's peer) or "decode" (a prefill's peer)
    addr: str | None = None
    id: int | None = None
    agent: str | None = None
    healthy: bool | None = None
    tp: int | None = None
    ep: int | None = None
    requests: int | None = None
    outstanding: int | None = None
    load: int | None = None
    bytes_sent: int | None = None
    refused: str | None = None
    error: str | None = None
    connects: int | None = None
    connected_s: float | None = None
    last_seen_s: float | None = None
    sessions: int | None = None  # a router's target: sessions routed to it
    point: str | None = None  # a router's target: its decode point and context
    max_model_len: int | None = None
    kv_events: str | None = None  # a decode's prefill peer: where that peer publishes its KV events
    kv_events_replay: str | None = None
    # where the peer's own /admin/state answers (a prefill's admin port, a router target's API port): `trnd
    # top` given the front port follows it to every node of the deployment
    admin: str | None = None


class Routing(_S):
    """A router's decisions (trnd/router/): requests per rule, retries, failovers, prefixes remembered."""
    session: int = 0
    prefix: int = 0
    load: int = 0
    random: int = 0
    retries: int = 0
    failovers: int = 0
    prefix_entries: int = 0


# -- the L3 store ---------------------------------------------------------------------------------------

class Slots(_S):
    total: int = 0
    free: int = 0
    used: int = 0  # committed pages
    reserved: int = 0  # being written
    dropped: int = 0
    pinned: int = 0  # leased to a reader


class StoreClientView(_S):
    """A role connected to this store."""
    id: int = 0
    name: str = ""
    addr: str = ""
    namespace: str = ""
    connected_s: float = 0.0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    reserved: int = 0
    committed: int = 0
    rejected: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    corrupt: int = 0


# -- the whole state ------------------------------------------------------------------------------------

class State(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A role's fields only: what it does not have is left out of the JSON."""
    role: str = "?"  # serve | decode | prefill | store | router
    model: str | None = None
    point: str | None = None
    uptime_s: float | None = None
    draining: bool | None = None
    # engine roles
    running: list[Request] | None = None
    waiting: list[Request] | None = None
    pages: Pages | None = None
    radix: Radix | None = None
    tiers: Tiers | None = None
    stats: Stats | None = None
    layout: Layout | None = None
    limits: Limits | None = None
    capacity: Capacity | None = None
    static: Static | None = None
    integrity: Integrity | None = None
    kernels: Kernels | None = None  # the CPU backend only
    kv_events: KVEvents | None = None
    spec: Spec | None = None  # speculative decoding, where it is on
    # disaggregated roles (and the router: its targets are its peers)
    transfers: Transfers | None = None
    peers: list[Peer] | None = None
    routing: Routing | None = None
    # the store
    store_id: str | None = None
    memory_bytes: int | None = None
    slot_bytes: int | None = None
    slots: Slots | None = None
    leases: int | None = None
    reservations: int | None = None
    namespaces: dict[str, int] | None = None
    shape_from: str | None = None
    clients: list[StoreClientView] | None = None
    counters: dict[str, float | None] | None = None


# -- one request's path (/admin/requests/{id}) -----------------------------------------------------------

class Phase(_S):
    t: float = 0.0  # wall clock (time.time()): comparable across the processes of one host
    what: str = ""


class Trace(_S):
    """One request on one node, live or recently ended (engine/trace.py keeps the phases)."""
    id: str = "?"  # this node's id for it (prefill: p<peer>/<decode id>)
    session_id: str | None = None
    state: str = "done"  # a live request's Request.state, or done
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_from: dict[str, int] = {}  # device | host | remote | prefill -> tokens (usage's cached_tokens)
    loaded_from: dict[str, int] = {}  # host | remote | prefill_peer -> tokens that came into this engine
    generated_tokens: int = 0
    ttft_ms: float | None = None
    preemptions: int = 0
    finish_reason: str | None = None
    error: str | None = None
    phases: list[Phase] = []


class Traces(_S):
    role: str = "?"
    traces: list[Trace] = []


def sources(d: dict[str, int]) -> str:
    """A Trace's cached_from / loaded_from as "device=48 remote=12" ("none" if empty): the request log line's
    form (engine/trace.py) and `trnd top`'s (top/trace.py)."""
    return " ".join(f"{k}={v}" for k, v in d.items() if v) or "none"


def decode_traces(obj: bytes) -> Traces:
    return msgspec.json.decode(obj, type=Traces)


def decode(obj: dict | bytes) -> State:
    """A state from JSON bytes or a decoded JSON object."""
    if isinstance(obj, (bytes, str)):
        return msgspec.json.decode(obj, type=State)
    return msgspec.convert(obj, State)


def part(typ: type, obj: dict | None):
    """Build one part from a subsystem's counters dict, checked against the schema here."""
    return None if obj is None else msgspec.convert(obj, typ)
