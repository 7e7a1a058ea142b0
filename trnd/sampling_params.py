"""What a client asks of one generation. On the ground floor because the API, the engine and the
prefill wire message (transfer/protocol.py PrefillReq) all carry it."""

from __future__ import annotations

import msgspec

GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark", "ebnf")


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A structured-output constraint as plain data; engine/grammar.py compiles it (llguidance)."""
    kind: str  # one of GRAMMAR_KINDS
    value: str  # the schema as JSON text, the regex, a JSON list of choices, or the grammar text
    after: str | None = None  # unconstrained until the output contains this (reasoning end)


class SamplingParams(msgspec.Struct, kw_only=True):
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    grammar: GrammarSpec | None = None  # structured output (engine/grammar.py)
    priority: int = 0  # vLLM's field: lower is served first (engine/scheduler.py: admission, preemption)
    # The tenant's key space in every cache tier (cache/hashing.py): the API sets it from vLLM's `cache_salt`
    # and the API key (http/tenant.py); None: the shared space. Travels to prefill in PrefillReq.params.
    cache_salt: str | None = None
    # Disaggregated decode: the prefill peer (its control address) a router found holding this prompt's prefix
    # in its KV events (router/events.py); decode prefers it within a load slack (roles/decode.py _pick)
    prefill_hint: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1
