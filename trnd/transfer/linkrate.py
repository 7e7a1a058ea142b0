"""Decode's estimate of one prefill peer's link and compute, and the choice it feeds: is handing this
prompt to the peer slower than computing it here?

From each landed handoff: the link's rate from the spacing of the writes' notifications (bytes of all
writes but the first over the time from the first notification to the last: while the link is the
bottleneck the writes queue on it and land back to back at its rate; while compute is, they land a
chunk's compute apart and the estimate is low, so the link is never judged slower than compute that
paced it), and the peer's compute per token (KVDone.prefill_s). Both are moving averages.

A prompt of u uncached tokens goes to the peer unless moving its KV (u x bytes per token / rate) would
take longer than computing it here, estimated as the peer's compute per token (same model, and on this
project's nodes the same CPU class; a decode node's own prefill rate would be better where it differs).
Pipelining hides the shorter of the two under the longer, so the handoff costs at least the slower;
above that point recomputing is the faster way to the first token.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.5  # weight of the newest handoff


@dataclass
class LinkEstimate:
    bytes_per_s: float = 0.0  # 0: unknown
    compute_s_per_token: float = 0.0

    def observe(self, nbytes: int, writes: int, first_notif: float, last_notif: float, tokens: int,
                prefill_s: float) -> None:
        """One landed handoff: its bytes in `writes` writes whose notifications came first_notif..last_notif
        (decode's clock), `tokens` computed on the peer in prefill_s."""
        if writes >= 2 and last_notif > first_notif:
            rate = nbytes * (writes - 1) / writes / (last_notif - first_notif)
            self.bytes_per_s = rate if not self.bytes_per_s else ALPHA * rate + (1 - ALPHA) * self.bytes_per_s
        if tokens > 0 and prefill_s > 0:
            per = prefill_s / tokens
            self.compute_s_per_token = per if not self.compute_s_per_token else \
                ALPHA * per + (1 - ALPHA) * self.compute_s_per_token

    def slower_than_recompute(self, tokens: int, bytes_per_token: int) -> tuple[float, float] | None:
        """(link seconds, recompute seconds) for a prompt when the link is the slower, else None."""
        if not self.bytes_per_s or not self.compute_s_per_token:
            return None
        link_s = tokens * bytes_per_token / self.bytes_per_s
        compute_s = tokens * self.compute_s_per_token
        return (link_s, compute_s) if link_s > compute_s else None
