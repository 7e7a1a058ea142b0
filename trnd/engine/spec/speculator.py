"""Speculative decoding's side of the engine: who drafts, how many tokens, and whether it pays.

At the end of every step `propose` gives each decoding request up to K drafted tokens (Req.draft_ids);
the next step's scheduler reserves their pages, the runner verifies them as extra decode rows of that
one forward, the sampler keeps the accepted ones (engine/sampler.py verify) and `record` counts them.

It switches itself off where it does not pay: a request whose draft kept nothing waits 1, 3, 7, ...
up to MAX_IDLE steps before drafting again (a draft that keeps a token resets the wait), so at
acceptance 0 the drafted rows are about one step in MAX_IDLE + 1; the engine's steps are timed and
drafting stops at a batch size where steps with drafts emit fewer tokens per second than steps without
(engine/spec/payoff.py: acceptance above 0 that still does not pay, the first steps of every new
request); and with `disable_by_batch_size` (vLLM's field) nothing is drafted while that many requests
or more are running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from trnd import snapshot as S
from trnd.config import SpeculativeConfig
from trnd.engine.request import Req
from trnd.engine.spec import ngram
from trnd.engine.spec.payoff import Payoff

MAX_IDLE = 63  # steps a request that keeps missing waits between drafts, at most


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: drafts verified, tokens drafted, tokens accepted (and by position)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class _Backoff:
    misses: int = 0  # drafts in a row that kept nothing
    idle: int = 0  # steps left before the next draft


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, draft=None):
        """draft: the DraftProposer (engine/spec/draft.py) of method draft or mtp; None: n-gram lookup."""
        self.cfg, self.k, self.max_model_len, self.draft = cfg, cfg.num_speculative_tokens, max_model_len, draft
        self.stats = SpecStats(accepted_per_pos=[0] * self.k)
        self._backoff: dict[str, _Backoff] = {}
        self._ids: dict[str, tuple[np.ndarray, int]] = {}  # n-gram: each request's tokens (a buffer, its length)
        self.payoff = Payoff() if cfg.adaptive else None
        self._drafting: bool | None = None  # what the last propose decided for the next step (None: nothing to)
        self._propose_s = 0.0  # what that propose took (a draft model's forwards)

    @property
    def method(self) -> str:
        return self.cfg.method

    def propose(self, reqs: list[Req], num_running: int) -> None:
        """Draft for every request that is decoding and has none yet."""
        self._drafting, self._propose_s = None, 0.0
        if self.cfg.disable_by_batch_size is not None and num_running >= self.cfg.disable_by_batch_size:
            return
        if not reqs:
            return
        self._drafting = self.payoff is None or self.payoff.draft_now(len(reqs))
        if not self._drafting:
            return
        t0 = time.perf_counter()
        want = [(r, k) for r in reqs if not r.draft_ids and (k := self._room(r)) > 0]
        if want and self.draft is not None:
            self.draft.propose(want)
        elif want:
            lo, hi = self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
            for r, k in want:
                r.draft_ids = ngram.propose(self._tokens(r), k, lo, hi)
        self._propose_s = time.perf_counter() - t0

    def measured(self, batch: int, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch` requests emitted `tokens` in `seconds` (its forward and sampling);
        the propose before it decided whether it drafted and took the rest of its cost."""
        if self.payoff is not None and self._drafting is not None:
            self.payoff.record(batch, self._drafting, tokens, seconds + self._propose_s)

    def _tokens(self, r: Req) -> np.ndarray:
        """The request's tokens as an array kept across steps (only new tokens copied: a prompt may be 1M)."""
        buf, used = self._ids.get(r.rid, (None, 0))
        n = r.num_tokens
        if buf is None or n > buf.shape[0]:
            grown = np.empty(max(2 * n, 256), dtype=np.int64)
            if buf is not None:
                grown[:used] = buf[:used]
            buf = grown
        buf[used:n] = r.ids(used, n)
        self._ids[r.rid] = (buf, n)
        return buf[:n]

    def _room(self, r: Req) -> int:
        """How many tokens this request may draft now: K, fewer near max_tokens or the context's end (every
        drafted position needs a KV slot below max_model_len), 0 while it backs off or while its grammar waits
        for its start marker (the marker's tokens would move the mask mid-draft)."""
        b = self._backoff.get(r.rid)
        if b is not None and b.idle > 0:
            b.idle -= 1
            return 0
        if r.grammar is not None and r.grammar.after is not None:
            return 0
        p = r.params
        return min(self.k, p.max_tokens - r.num_output - 1, self.max_model_len - r.num_tokens)

    def record(self, r: Req, drafted: int, accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_pos[j] += 1
        b = self._backoff.setdefault(r.rid, _Backoff())
        if accepted:
            b.misses = b.idle = 0
        else:
            b.misses += 1
            b.idle = min(2 ** b.misses - 1, MAX_IDLE)

    def state(self) -> S.Spec:
        s, d = self.stats, self.draft
        return S.Spec(method=self.method, num_speculative_tokens=self.k, num_drafts=s.num_drafts,
                      num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                      accepted_per_pos=list(s.accepted_per_pos), acceptance=round(s.acceptance, 4),
                      mean_accepted_length=round(1 + s.num_accepted_tokens / s.num_drafts, 3) if s.num_drafts else 0.0,
                      backing_off=sum(b.idle > 0 for b in self._backoff.values()),
                      plain_steps=self.payoff.plain_steps if self.payoff else 0,
                      payoff={b: [_round(d), _round(p)] for b, (d, p) in self.payoff.state().items()}
                      if self.payoff else {},
                      draft_pages=d.pool.num_pages - d.pool.num_free if d else None,
                      draft_pages_total=d.pool.num_pages if d else None)

    def check_integrity(self, live: set[str]) -> None:
        """No state (no draft pages) for a request the engine no longer has. Raises AssertionError."""
        gone = [rid for rid in (*self._backoff, *self._ids, *(self.draft.seqs if self.draft else ())) if rid not in live]
        assert not gone, f"speculative state kept for ended requests: {gone[:8]}"
        if self.draft is not None:
            self.draft.check_integrity()

    def release(self, rid: str) -> None:
        """The request ended: its draft state (and its draft pages) go."""
        self._backoff.pop(rid, None)
        self._ids.pop(rid, None)
        if self.draft is not None:
            self.draft.release(rid)


def _round(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 1)
