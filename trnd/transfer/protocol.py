"""Control-plane messages between roles: msgspec Structs in one tagged union per channel, sent as
length-prefixed msgpack frames, each authenticated with HMAC-SHA256 and a per-connection sequence.

Never pickle: a frame decodes only into the types below.

The handshake (`challenge`, `answer`): the accepting side speaks first, a `Challenge` with its fresh
nonce; the connecting side's Hello is MACed with a key derived from the secret and that nonce, so a
Hello recorded on one connection proves nothing on another. From then on both sides use the session
key of both nonces, and the sequence number (which must grow by exactly one) rejects duplicates and
replays within a connection. Before the Hello authenticates, a frame may not exceed
MAX_HANDSHAKE_FRAME (an unauthenticated peer cannot make us buffer more). A forged, duplicate or
malformed frame after the handshake is logged and dropped; the connection and the loop go on.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets

import msgspec

from trnd.aio import within
from trnd.sampling_params import SamplingParams

log = logging.getLogger("trnd.control")

PROTOCOL_VERSION = 2  # 2: SamplingParams carries grammar + logit_bias (a v1 prefill would drop them)
MAX_FRAME = 64 * 2**20
MAX_HANDSHAKE_FRAME = 64 * 2**10  # a Hello is ~2 KB (NIXL's agent metadata is ~0.5 KB)
HANDSHAKE_TIMEOUT_S = 10.0


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One KV pool of a role (model/config.py PoolKind; roles/common.py pool_spec): both roles must hold the same."""
    kind: str  # "gqa" (K|V per KV head) or "latent" (MLA: one latent + rope row, replicated on every rank)
    dtype: str  # the pages' dtype (fp8 formats included)
    layout: list[int]  # the canonical page (every head) as [layers, parts, heads, page_size, width]
    bytes_per_token: int  # one token in every layer of the canonical page (values; fp8 scales aside)


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a role is: the handshake compares every field that must agree between prefill and decode."""
    protocol_version: int = PROTOCOL_VERSION
    role: str
    model_name: str
    model_fingerprint: str  # sha256 of config.json + tokenizer.json: same weights layout, same token ids
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    point: str
    max_context: int
    max_batch: int
    tp: int
    # reported, never compared: the KV pages depend on tp (rank_heads) alone, so a pair may split experts its own
    # way (prefill tp=2 ep=2 hands off to decode tp=1)
    ep: int = 1
    rank_heads: list[tuple[int, int]]  # [start, end) KV heads held by each rank
    page_bytes: int  # one page on one rank
    kv_cache_dtype: str = "auto"  # KV page format (auto: the model dtype; fp8_*: fp8 values + scales)
    transfer_backend: str = "ucx"  # the NIXL backend that moves the pages (transfer/nixl.py): both ends load the same
    # SpeculativeConfig.contract() ({}: off): a decode server drafting with a config its prefill peer was not
    # started with is refused, naming the field (the pair's acceptance must be the aggregated one's)
    speculative_config: dict[str, str | int | None] = msgspec.field(default_factory=dict)
    pools: list[PoolSpec] = msgspec.field(default_factory=list)  # the KV pools, one per kind (today one)


# Fields that must be equal on both sides, in the order they are reported.
MUST_MATCH = ("protocol_version", "model_fingerprint", "point", "dtype", "kv_cache_dtype", "transfer_backend",
              "pools", "num_layers", "num_kv_heads", "head_dim", "page_size", "max_context", "max_batch",
              "speculative_config")


def pools_mismatch(a: Manifest, b: Manifest) -> str | None:
    """The first pool field that differs, as pools[KIND].FIELD with both sides' values."""
    kinds = [p.kind for p in a.pools], [p.kind for p in b.pools]
    if kinds[0] != kinds[1]:
        return f"pools: {a.role} has {kinds[0]!r}, {b.role} has {kinds[1]!r}"
    for x, y in zip(a.pools, b.pools):
        for f in x.__struct_fields__:
            if getattr(x, f) != getattr(y, f):
                return f"pools[{x.kind}].{f}: {a.role} has {getattr(x, f)!r}, {b.role} has {getattr(y, f)!r}"
    return None


def mismatch(a: Manifest, b: Manifest) -> str | None:
    for f in MUST_MATCH:
        if f == "pools":
            if why := pools_mismatch(a, b):
                return why
            continue
        if f == "speculative_config" and a.speculative_config and b.speculative_config:
            for key in sorted(set(a.speculative_config) | set(b.speculative_config)):
                x, y = a.speculative_config.get(key), b.speculative_config.get(key)
                if x != y:
                    return f"speculative_config.{key}: {a.role} has {x!r}, {b.role} has {y!r}"
        if getattr(a, f) != getattr(b, f):
            hint = (" (dtype = auto computes float32 on CPUs without native bf16: set the same dtype on both roles)"
                    if f == "dtype" else "")
            return f"{f}: {a.role} has {getattr(a, f)!r}, {b.role} has {getattr(b, f)!r}{hint}"
    return None


class PoolRegion(msgspec.Struct, array_like=True):
    addr: int
    num_pages: int


class Challenge(msgspec.Struct, tag=True):
    """accepting side -> connecting side, the first frame: the nonce the Hello's MAC must cover."""
    nonce: bytes


class Hello(msgspec.Struct, tag=True):
    """decode -> prefill, the answer to the Challenge: MACed with hello_key(secret, challenge)."""
    manifest: Manifest
    agent_name: str
    agent_meta: bytes  # NIXL agent metadata (NIXL's own serialization, parsed by NIXL, not Python)
    regions: list[PoolRegion]  # decode's KV pool per rank: where prefill writes
    nonce: bytes


class Welcome(msgspec.Struct, tag=True):
    manifest: Manifest
    agent_name: str
    agent_meta: bytes
    nonce: bytes
    # prefill's KV events (trnd/events), so a router reading decode's /admin/state can route the prefill leg
    kv_events: str | None = None
    kv_events_replay: str | None = None
    admin_port: int | None = None  # the prefill's admin HTTP port (/admin/state), on the host decode dialed


class Refused(msgspec.Struct, tag=True):
    reason: str


class PrefillReq(msgspec.Struct, tag=True):
    """Compute the KV of prompt_ids, write pages [skip_pages, ...) to dst_pages, sample the first token."""
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    skip_pages: int  # leading pages decode already holds (its prefix cache): not sent
    dst_pages: list[int]  # decode page ids for page indices skip_pages.. ceil(len(prompt)/page_size)-1
    # Decode's wall clock (time.time()) after which no write for rid may be posted: decode frees the
    # target pages of a lost peer only after it (+ fence_s), so a prefill that was stopped and resumes,
    # or reads this from its socket late, posts nothing into reused pages. 0: no deadline.
    expires: float = 0.0
    session: str | None = None  # the client's session (or user), for prefill's per-request log line


class Abort(msgspec.Struct, tag=True):
    rid: str


class Aborted(msgspec.Struct, tag=True):
    """No write for rid is in flight or will be issued: decode may reuse its pages."""
    rid: str


class KVDone(msgspec.Struct, tag=True):
    rid: str
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    num_xfers: int  # NIXL transfers (one per chunk) whose notifications decode must have seen
    computed_tokens: int  # prompt tokens prefill computed (the rest came from its prefix cache)
    # prefill's cache hits by source (device, host, remote: in prefix order), for decode's cached_tokens
    cached_from: dict[str, int] = {}
    # xxh3-128 of every byte the writes moved, in prompt-page order (transfer/digest.py); b"": none taken
    digest: bytes = b""
    descriptors: int = 0  # NIXL descriptors the writes posted (after coalescing), for decode's timeline
    prefill_s: float = 0.0  # prefill's time from taking the request to its first token (transfer/linkrate.py)


class PrefillFailed(msgspec.Struct, tag=True):
    rid: str
    reason: str


class Ping(msgspec.Struct, tag=True):
    t: float


class Pong(msgspec.Struct, tag=True):
    t: float
    load: int = 0  # requests queued or running on the prefill server (a store sends none)


Message = Challenge | Hello | Welcome | Refused | PrefillReq | Abort | Aborted | KVDone | PrefillFailed | Ping | Pong


class Frame(msgspec.Struct, array_like=True):
    seq: int
    mac: bytes
    body: bytes


_frame_enc = msgspec.msgpack.Encoder()
_frame_dec = msgspec.msgpack.Decoder(Frame)
_msg_dec = msgspec.msgpack.Decoder(Message)


def session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, b"trnd-session" + client_nonce + server_nonce, hashlib.sha256).digest()


def hello_key(secret: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, b"trnd-hello" + challenge, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


class ChannelClosed(ConnectionError):
    pass


class Channel:
    """One authenticated, ordered message stream over a TCP connection. Subclasses name their own
    channel's tagged union in `decoder` (the store channel does)."""

    decoder = _msg_dec

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, name: str = "peer"):
        self.reader, self.writer, self.key, self.name = reader, writer, key, name
        self.secret = key
        self.max_frame = MAX_HANDSHAKE_FRAME  # until the handshake authenticates (rekey to the session)
        self.send_seq = 0
        self.recv_seq = 0
        self.rejected = 0
        self._lock = asyncio.Lock()

    def rekey(self, key: bytes) -> None:
        """To the session key: the handshake is over, full-size frames from now on."""
        self.key = key
        self.max_frame = MAX_FRAME

    async def challenge(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> tuple[Message, bytes]:
        """Accepting side: send our nonce, return (the peer's first message, our nonce). That message
        authenticated under hello_key(secret, our nonce): it was made for this connection. The
        caller answers under the session key (`session(msg.nonce, ours)`)."""
        ours = new_nonce()
        await self.send(Challenge(ours))
        self.key = hello_key(self.secret, ours)
        msg = await within(self.recv(strict=True), timeout)
        return msg, ours

    async def answer(self, make_hello, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """Connecting side: wait for the Challenge, send make_hello(our nonce) under hello_key, then
        switch to the session key (the reply, Welcome or Refused, comes under it)."""
        msg = await within(self.recv(strict=True), timeout)
        if not isinstance(msg, Challenge):
            raise ChannelClosed(f"{self.name}: expected a Challenge, got {type(msg).__name__}")
        ours = new_nonce()
        self.key = hello_key(self.secret, msg.nonce)
        await self.send(make_hello(ours))
        self.session(ours, msg.nonce)

    def session(self, client_nonce: bytes, server_nonce: bytes) -> None:
        self.rekey(session_key(self.secret, client_nonce, server_nonce))

    def _mac(self, seq: int, body: bytes) -> bytes:
        return hmac.new(self.key, seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    async def send(self, msg: Message) -> None:
        body = _frame_enc.encode(msg)
        async with self._lock:
            self.send_seq += 1
            data = _frame_enc.encode(Frame(self.send_seq, self._mac(self.send_seq, body), body))
            self.writer.write(len(data).to_bytes(4, "big") + data)
            await self.writer.drain()

    async def recv(self, strict: bool = False) -> Message:
        """The next valid message; invalid frames are logged, counted and skipped (strict: the
        connection is dropped instead, as for a handshake that does not authenticate)."""
        while True:
            if strict and self.rejected:
                raise ChannelClosed(f"{self.name}: handshake did not authenticate")
            try:
                n = int.from_bytes(await self.reader.readexactly(4), "big")
                if n > self.max_frame:
                    raise ChannelClosed(f"{self.name}: frame of {n} bytes exceeds {self.max_frame}"
                                        + (" before the handshake" if self.max_frame < MAX_FRAME else ""))
                data = await self.reader.readexactly(n)
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
                raise ChannelClosed(f"{self.name}: connection lost ({e.__class__.__name__})") from None
            try:
                frame = _frame_dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.reject(f"malformed frame ({e})")
                continue
            if not hmac.compare_digest(frame.mac, self._mac(frame.seq, frame.body)):
                self.reject(f"bad MAC on frame seq {frame.seq} (forged, or a different secret)")
                continue
            if frame.seq != self.recv_seq + 1:
                self.reject(f"frame seq {frame.seq}, expected {self.recv_seq + 1} (duplicate or replay)")
                continue
            try:
                msg = self.decoder.decode(frame.body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.recv_seq = frame.seq
                self.reject(f"malformed message ({e})")
                continue
            self.recv_seq = frame.seq
            return msg

    def reject(self, why: str) -> None:
        """Count and log a message this side will not act on (the connection stays)."""
        self.rejected += 1
        log.warning("control message from %s rejected: %s", self.name, why)

    def close(self) -> None:
        self.writer.close()
