"""Per-request log lines, on the `trnd.request` logger: debug, one line per phase (queued, prefill
start, KV loaded from L2/L3, handed to / received from a prefill peer, first token, preempted); info,
one line when the request ends, with where its KV came from. Every role's engine writes them (the
prefill role's rids are `p<peer>/<decode rid>`), so one grep for the API request id follows it across
processes.
"""

from __future__ import annotations

import logging
import time

from trnd.engine.request import Req

log = logging.getLogger("trnd.request")

SOURCES = ("device", "host", "remote", "prefill")  # Req.cached_from keys, in prefix order


def phase(req: Req, what: str) -> None:
    if log.isEnabledFor(logging.DEBUG):
        log.debug("request %s: %s (%.1f ms since arrival)", req.rid, what, (time.monotonic() - req.arrival) * 1e3)


def _parts(d: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items() if v) or "none"


def finished(req: Req, reason: str, error: BaseException | None = None) -> None:
    """The one info line per request: id, session, prompt tokens, cached tokens by where they were found
    (this engine's radix cache, L2, L3: here or on the prefill peer, the peer's radix cache), loaded
    tokens by where they came into this engine from (its L2, its L3, the prefill peer's writes), TTFT,
    tokens out, finish reason."""
    if not log.isEnabledFor(logging.INFO):
        return
    loaded = dict(req.loaded_from)
    if req.received:
        loaded["prefill_peer"] = req.received
    ttft = f"{(req.first_token_time - req.arrival) * 1e3:.1f}ms" if req.first_token_time is not None else "-"
    log.info("request %s done: session=%s prompt=%d cached=%d [%s] loaded=%d [%s] ttft=%s out=%d "
             "preemptions=%d finish=%s%s", req.rid, req.session_id or "-", req.num_prompt, req.cached_tokens,
             _parts(req.cached_from), sum(loaded.values()), _parts(loaded), ttft, req.num_output,
             req.num_preemptions, reason, f" error={error}" if error is not None else "")
