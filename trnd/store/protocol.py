"""Control-plane messages between a role (the store client) and `trnd store`.

The same framing and authentication as the role-to-role channel (transfer/protocol.py: length-
prefixed msgpack frames, HMAC-SHA256 with a per-connection sequence, session key from the two
handshake nonces), with its own tagged union: a frame on this channel decodes only into the types
below. Page bytes never cross this channel; they move over NIXL straight between the client's KV
pool and the store's slots.

A connection is bound to one key space at the handshake (the client's namespace plus its page
geometry), so requests carry only page hashes. Requests carry an id that their reply repeats, so a
client keeps many requests in flight on one connection.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Annotated

import msgspec
from msgspec import Meta

from trnd.transfer.protocol import Challenge, Channel, ChannelClosed, Ping, Pong, Refused, new_nonce, session_key

# The handshake's first and last words and the heartbeat are the roles' own (transfer/protocol.py).
__all__ = ["Challenge", "Channel", "ChannelClosed", "Ping", "Pong", "Refused", "StoreChannel", "new_nonce",
           "session_key"]

STORE_PROTOCOL_VERSION = 1
MAX_HASHES = 1 << 16  # pages in one request

PageHash = Annotated[bytes, Meta(min_length=32, max_length=32)]
Checksum = Annotated[bytes, Meta(min_length=16, max_length=16)]
Hashes = Annotated[list[PageHash], Meta(max_length=MAX_HASHES)]


CHECKSUM_THREADS = 4


def checksum(data) -> bytes:
    """blake2b-128 of a canonical page's bytes (anything with the buffer protocol)."""
    return hashlib.blake2b(data, digest_size=16).digest()


async def checksums(hash_all: Callable[[list[int]], list[bytes]], pages: list[int]) -> list[bytes]:
    """hash_all(pages) in up to CHECKSUM_THREADS slices on the loop's executor threads (blake2b lets go
    of the GIL), in order: the client's pages and the store's slots alike."""
    loop = asyncio.get_running_loop()
    k = -(-len(pages) // CHECKSUM_THREADS) or 1
    parts = await asyncio.gather(*(loop.run_in_executor(None, hash_all, pages[i:i + k])
                                   for i in range(0, len(pages), k)))
    return [c for part in parts for c in part]


class StoreManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a client's pages are: the key space and the canonical page (tp=1, every KV head)."""
    protocol_version: int = STORE_PROTOCOL_VERSION
    namespace: str  # page-hash namespace (Engine.namespace: model fingerprint and KV dtype)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    itemsize: int
    page_bytes: int  # one canonical page: num_layers * parts * num_kv_heads * (page_size * head_dim * itemsize + scale_bytes)
    scale_bytes: int = 0  # fp8 pages: each (layer, k|v, head) block ends with its fp32 scale (kernels/fp8.py)
    # the pool kind (transfer/plan.py Layout): K|V blocks (2) of num_kv_heads x head_dim, or MLA's latent (1 part,
    # 1 head, head_dim = kv_lora_rank + qk_rope_head_dim)
    parts: int = 2
    kind: str = "gqa"

    def key_space(self) -> str:
        """The store's namespace for this client: equal only for the same hashes AND the same bytes."""
        return (f"{self.namespace}|{self.dtype}|L{self.num_layers}|H{self.num_kv_heads}|D{self.head_dim}"
                f"|P{self.page_size}|B{self.itemsize}" + (f"|S{self.scale_bytes}" if self.scale_bytes else "")
                + ("" if self.kind == "gqa" else f"|{self.kind}{self.parts}"))

    def geometry_error(self) -> str | None:
        want = self.num_layers * self.parts * self.num_kv_heads * (self.page_size * self.head_dim * self.itemsize
                                                                   + self.scale_bytes)
        if self.page_bytes != want or want <= 0:
            return (f"page_bytes: client says {self.page_bytes}, its geometry ({self.kind} pool of {self.parts} "
                    f"parts, layers {self.num_layers}, kv heads {self.num_kv_heads}, page_size {self.page_size}, "
                    f"head_dim {self.head_dim}, itemsize {self.itemsize}, scale_bytes {self.scale_bytes}) makes {want}")
        return None


class StoreHello(msgspec.Struct, tag=True):
    """client -> store, first frame, MACed with the shared secret itself."""
    manifest: StoreManifest
    client: str  # the client's NIXL agent name (logs, /admin/state)
    nonce: bytes


class StoreWelcome(msgspec.Struct, tag=True):
    store_id: str  # new at every start: a client that sees it change knows the store lost its data
    agent_name: str
    agent_meta: bytes  # NIXL's own serialization, parsed by NIXL (never pickled)
    region_addr: int  # slot s is at region_addr + s * slot_bytes in the store's registered region
    slot_bytes: int
    num_slots: int
    lease_s: float
    nonce: bytes
    admin_port: int | None = None  # the store's admin HTTP port (/admin/state), on the host the client dialed


class Lookup(msgspec.Struct, tag=True):
    """How many leading hashes are committed; lease: pin them for a read (released by Release or after
    lease_s)."""
    id: int
    hashes: Hashes
    lease: bool = False


class Found(msgspec.Struct, tag=True):
    id: int
    slots: list[int]  # of the leading committed hashes
    checksums: list[bytes]
    lease: int  # 0: no lease


class Reserve(msgspec.Struct, tag=True):
    id: int
    hashes: Hashes


class Reserved(msgspec.Struct, tag=True):
    """Per hash: a slot to WRITE the canonical page into, or HAVE (-1) / BUSY (-2) / FULL (-3)."""
    id: int
    reservation: int  # 0: nothing reserved
    slots: list[int]


class Commit(msgspec.Struct, tag=True):
    """The bytes of these reserved pages are in their slots: verify, then serve them."""
    id: int
    reservation: int
    hashes: Hashes
    checksums: list[Checksum]


class Committed(msgspec.Struct, tag=True):
    id: int
    ok: list[bool]  # per hash of the Commit: verified and committed


class Abandon(msgspec.Struct, tag=True):
    """The writer gives up on a reservation (its transfer failed): free the slots now."""
    reservation: int


class Release(msgspec.Struct, tag=True):
    lease: int


class Corrupt(msgspec.Struct, tag=True):
    """The client read these pages and their bytes did not match the checksum: the store re-checks
    its slots and drops the ones that are bad."""
    hashes: Hashes


class Failed(msgspec.Struct, tag=True):
    id: int
    reason: str


StoreMessage = (Challenge | StoreHello | StoreWelcome | Refused | Lookup | Found | Reserve | Reserved | Commit | Committed
                | Abandon | Release | Corrupt | Failed | Ping | Pong)

_msg_dec = msgspec.msgpack.Decoder(StoreMessage)


class StoreChannel(Channel):
    """transfer/protocol.Channel (send, framing, MAC, sequence, strict handshake) decoding the store's
    union instead of the roles' one."""

    decoder = _msg_dec
