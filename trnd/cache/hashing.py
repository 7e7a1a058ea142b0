"""Chained page hashes: a stable name for "the KV of this full page after this exact prefix".

Key space (keep stable: host/remote tiers and the KV handoff use these keys across processes):
    h_{-1} = parent                      if a parent hash is given (continuing a chain), else
           = sha256(namespace as utf-8)                     without a cache salt, or
           = sha256(namespace || 0x00 || "salt=" || salt)   with one (a tenant's own key space)
    h_i    = sha256(h_{i-1} || tokens of page i as little-endian int32)
One 32-byte digest per FULL page; a trailing partial page has no hash. Because each hash covers its
parent, equal hashes mean equal whole prefixes, so a page's KV can be looked up by hash alone.
The namespace names the model and KV layout (weights, dtype, page_size, ...): different namespaces
never share keys. The cache salt (vLLM's `cache_salt`, or the default one of an API key: salt.py) enters
the root, so two salts never share a page hash: not in the device cache, L2, L3, KV events or routes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 32


def root_hash(namespace: str, salt: str | None = None) -> bytes:
    """h_{-1} of a chain that starts at token 0 (under `salt`: a key space no other salt shares)."""
    data = namespace.encode("utf-8")
    if salt:
        data += b"\0salt=" + salt.encode("utf-8")
    return hashlib.sha256(data).digest()


def page_hashes(token_ids: Sequence[int], page_size: int, namespace: str, parent: bytes = b"",
                salt: str | None = None) -> list[bytes]:
    """One chained sha256 per full page of token_ids; `parent` continues an earlier chain (which
    already carries its salt), else the chain starts at root_hash(namespace, salt)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    if parent and len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    prev = parent or root_hash(namespace, salt)
    pack = struct.Struct(f"<{page_size}i").pack
    out = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        try:
            data = pack(*token_ids[start:start + page_size])
        except struct.error as e:
            raise ValueError(f"token ids must fit in int32 (page at token {start}): {e}") from None
        prev = hashlib.sha256(prev + data).digest()
        out.append(prev)
    return out


def hash_hex(h: bytes, n: int | None = 16) -> str:
    """Hex of a page hash for logs; the first n hex digits (all when n is None)."""
    s = h.hex()
    return s if n is None else s[:n]
