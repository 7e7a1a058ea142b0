"""Per-request log lines, on the `trnd.request` logger: debug, one line per phase (queued, prefill
start, KV loaded from L2/L3, handed to / received from a prefill peer, first token, preempted); info,
one line when the request ends, with where its KV came from. Every role's engine writes them (the
prefill role's rids are `p<peer>/<decode rid>`), so one grep for the API request id follows it across
processes. The same phases are kept on the request (`Req.trail`) and, once it ends, in the engine's
`recent` ring, for /admin/requests/{id} (engine/state.py) and `trnd top`'s request path view.
"""

from __future__ import annotations

import logging
import time

from trnd import snapshot as S
from trnd.engine.request import Req

log = logging.getLogger("trnd.request")

MAX_PHASES = 128  # per request (a request preempted over and over keeps its first ones); a 64K prompt
#                   handed off in 2048-token chunks is ~70: each write posted and done, the digest, the first token


def _short(session: str | None, limit: int = 128) -> str | None:
    """A client's session id as the log line shows it: cut beyond `limit` characters (it may be megabytes)."""
    return session if session is None or len(session) <= limit else f"{session[:limit]}...({len(session)} chars)"


def phase(req: Req, what: str) -> None:
    if len(req.trail) < MAX_PHASES:
        req.trail.append((time.time(), what))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("request %s: %s (%.1f ms since arrival)", req.rid, what, (time.monotonic() - req.arrival) * 1e3)


def finished(req: Req, reason: str, error: BaseException | None = None) -> S.Trace:
    """The one info line per request: id, session, prompt tokens, cached tokens by where they were found
    (this engine's radix cache, L2, L3: here or on the prefill peer, the peer's radix cache), loaded
    tokens by where they came into this engine from (its L2, its L3, the prefill peer's writes), TTFT,
    tokens out, finish reason. Returns the request's Trace for the engine's `recent` ring."""
    t = record(req, "done", reason, error)
    if log.isEnabledFor(logging.INFO):
        log.info("request %s done: session=%s prompt=%d cached=%d [%s] loaded=%d [%s] ttft=%s out=%d "
                 "preemptions=%d finish=%s%s", req.rid, _short(req.session_id) or "-", req.num_prompt, t.cached_tokens,
                 S.sources(t.cached_from), sum(t.loaded_from.values()), S.sources(t.loaded_from),
                 f"{t.ttft_ms:.1f}ms" if t.ttft_ms is not None else "-", req.num_output, req.num_preemptions,
                 reason, f" error={error}" if error is not None else "")
    return t


def record(req: Req, state: str, reason: str | None = None, error: BaseException | None = None) -> S.Trace:
    loaded = dict(req.loaded_from)
    if req.received:
        loaded["prefill_peer"] = req.received
    ttft = (req.first_token_time - req.arrival) * 1e3 if req.first_token_time is not None else None
    return S.Trace(id=req.rid, session_id=req.session_id, state=state, prompt_tokens=req.num_prompt,
                   cached_tokens=req.cached_tokens, cached_from=dict(req.cached_from), loaded_from=loaded,
                   generated_tokens=req.num_output, ttft_ms=round(ttft, 3) if ttft is not None else None,
                   preemptions=req.num_preemptions, finish_reason=reason,
                   error=str(error) if error is not None else None,
                   phases=[S.Phase(t=round(t, 6), what=w) for t, w in req.trail])
