"""A client's session id as every port keeps it: at most a fixed size, whatever the client sent.

A session id (`session_id`, `prompt_cache_key`, `x-session-id`, or `user` where no session is given) only
labels requests: the router's affinity hash, the log line, /admin/state and trnd top. Kept as sent, one
client's megabyte ids stay in every table that remembers requests (the router's sessions, a server's ring
of recent traces), so each is cut to a fixed size on entry: the router hashes every id (it forwards it in a
header, where no client string goes as written), a server keeps a short id as sent (readable in trnd top)
and hashes a long one the same way, so one long id is one session whether it came direct or through a router.
"""

from __future__ import annotations

import hashlib

MAX_SESSION_CHARS = 128  # a server keeps ids up to this as sent; longer ones become their session_key


def session_key(session: str) -> str:
    """32 hex characters whatever the client sent (2 MB, a line break, a NUL, a lone surrogate)."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def kept_session(session: str | None) -> str | None:
    """What a server keeps of a request's session: as sent up to MAX_SESSION_CHARS, else its session_key."""
    if not session:
        return None
    return session if len(session) <= MAX_SESSION_CHARS else session_key(session)
