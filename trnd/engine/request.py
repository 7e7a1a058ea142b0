"""The request record: one mutable `Req` per sequence, with plain public counters.

Token accounting (all counts are tokens, indices are into `all_ids`):
  all_ids = prompt_ids + output_ids
  [0, num_cached)     KV found in the prefix cache at admission (pages shared, locked)
  [0, num_computed)   KV present in this request's pages (cached + computed by us)
  pages[i] holds the KV of tokens [i * page_size, (i + 1) * page_size)
  draft_ids: tokens proposed after all_ids (speculative decoding, engine/spec/): the next decode step
  computes their KV too and keeps the accepted ones; num_computed never counts a drafted token
"""

from __future__ import annotations

import enum
import itertools
import time

from trnd.sampling_params import SamplingParams  # noqa: F401  (re-exported: the engine's callers)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Req:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
                 session_id: str | None = None):
        if not prompt_ids:
            raise ValueError("prompt_ids: a request needs at least one prompt token")
        self.rid = rid if rid is not None else f"req-{next(_ids)}"
        self.session_id = session_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.grammar = None  # GrammarState (engine/grammar.py) when params.grammar is set
        self.draft_ids: list[int] = []  # speculative decoding: verified by the next decode step (engine/spec/)
        self.draft_probs = None  # [len(draft_ids), vocab] the draft model's distributions, when it sampled them
        self.status = Status.WAITING
        self.pages: list[int] = []
        self.num_cached = 0  # prefix-cache hit at the latest admission
        self.num_computed = 0
        self.num_locked_pages = 0  # leading pages borrowed from the radix cache (locked there)
        self.num_loaded = 0  # of num_cached: tokens loaded from a lower tier (host L2, remote L3)
        # What usage.prompt_tokens_details.cached_tokens counts, by source: device (this radix cache), host
        # (L2), remote (L3), prefill (a prefill peer's radix cache). Set at admission until the request is
        # preempted or has a token (a recompute after that is not a cache hit the client sees).
        self.cached_from: dict[str, int] = {}
        self.loaded_from: dict[str, int] = {}  # tokens this engine's own tiers loaded back (host, remote)
        self.received = 0  # prompt tokens whose KV a prefill peer wrote into this engine's pages (decode)
        self.trail: list[tuple[float, str]] = []  # (wall clock, phase): engine/trace.py
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.overtaken = 0  # admissions of later, higher-priority requests ahead of it (scheduler's bound)
        self.handoffs = 0  # times its prompt KV was asked of a prefill peer (decode: retries on a lost peer)
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Per-output-token (logprob, [(token, logprob), ...]) when params.logprobs is set.
        self.output_logprobs: list[tuple[float, list[tuple[int, float]]]] = []

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids: a step reads a few tokens of what may be a
        1M-token prompt, and all_ids copies the whole of it."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_from.values())

    @property
    def usage_open(self) -> bool:
        """cached_from still follows admissions (no token yet, never preempted)."""
        return self.num_output == 0 and self.num_preemptions == 0

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1 or self.num_output == 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Req({self.rid}, prompt={self.num_prompt}, out={self.num_output}, "
                f"computed={self.num_computed}, pages={len(self.pages)}, {self.status.value})")
