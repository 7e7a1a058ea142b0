"""Chained page hashes: a stable name for "the KV of this full page after this exact prefix".

Key space (keep stable: host/remote tiers and the KV handoff use these keys across processes):
    h_{-1} = parent                      if a parent hash is given (continuing a chain), else
           = sha256(namespace as utf-8)
    h_i    = sha256(h_{i-1} || tokens of page i as little-endian int32)
One 32-byte digest per FULL page; a trailing partial page has no hash. Because each hash covers its
parent, equal hashes mean equal whole prefixes, so a page's KV can be looked up by hash alone.
The namespace names the model and KV layout (weights, dtype, page_size, ...): different namespaces
never share keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 32


def root_hash(namespace: str) -> bytes:
    """h_{-1} of a chain that starts at token 0."""
    return hashlib.sha256(namespace.encode("utf-8")).digest()


def page_hashes(token_ids: Sequence[int], page_size: int, namespace: str, parent: bytes = b"") -> list[bytes]:
    """One chained sha256 per full page of token_ids; `parent` continues an earlier chain."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    if parent and len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    prev = parent or root_hash(namespace)
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
