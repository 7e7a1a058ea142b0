"""Names every role on a port agrees on: a node's admin URL, and a Responses API response id,
`resp_{conversation}_{own}`. Every response that follows another by previous_response_id keeps its
conversation key, so the router (which knows no API) sends a whole conversation to the decode server that
stores it (api/responses.py)."""

from __future__ import annotations

import re

CONVERSATION = re.compile(r"[0-9a-f]{1,32}")


def conversation_of(response_id: str) -> str | None:
    """The conversation key in a response id, or None for an id trnd did not make."""
    parts = response_id.split("_", 2)
    ok = len(parts) == 3 and parts[0] == "resp" and CONVERSATION.fullmatch(parts[1])
    return parts[1] if ok else None


def admin_url(addr: str, admin_port: int | None) -> str | None:
    """A peer's admin URL from the address this role dialed (host:port) and the admin port it told us."""
    if admin_port is None:
        return None
    host = addr.rsplit(":", 1)[0] if ":" in addr else addr
    return f"http://{host}:{admin_port}"
