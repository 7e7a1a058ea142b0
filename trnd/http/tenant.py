"""Whose prefix cache a request may use: the cache salt every tier keys its pages under.

vLLM isolates tenants with a per-request `cache_salt` (CVE-2025-46570: timing a cache hit told one
tenant what another had asked). trnd keys every tier's pages (device, L2, L3), its KV events and its
routes by a salt that comes from two things:
  - the API key the request was accepted with, where the server has keys: each key is its own tenant
    (a default salt per key), and a client cannot reach another key's pages by sending its salt;
  - the body's `cache_salt`, vLLM's field: a further split within one key (or the only one, without
    keys, as in vLLM).
No key and no `cache_salt` is the shared key space of a single-tenant server, as before. The salt is a
digest: the key never appears in it (it travels in KV events' extra_keys, as vLLM's salt does).
A router in front passes its clients' salt on as the body's `cache_salt` (trnd/router/app.py), and the
decode server salts it again with the key the router presents: tenants stay apart end to end.
"""

from __future__ import annotations

import hashlib

MAX_SALT_CHARS = 256


def tenant_salt(api_key: bytes | str | None, cache_salt: str | None) -> str | None:
    """The salt a request's pages are keyed under (cache/hashing.py root_hash), or None: shared."""
    if not api_key:
        return cache_salt or None
    key = api_key.encode() if isinstance(api_key, str) else api_key
    h = hashlib.blake2b(key, digest_size=16, person=b"trnd-tenant")
    if cache_salt:
        h.update(b"\0" + cache_salt.encode("utf-8"))
    return "t-" + h.hexdigest()


def bearer(headers) -> bytes | None:
    """The key of an `Authorization: Bearer <key>` header (what http/auth.py accepted), or None."""
    value = headers.get("authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].encode()
    return None
