"""Structured outputs: a grammar per request (llguidance), one token mask per step for the rows that
have one, applied by the sampler.

Why llguidance (measured in the commit that added this file, 32k vocab, batch 8): a mask step of
~0.1 ms, compile ~0.3 ms per schema, and no dependency beyond its own wheel (xgrammar needs
transformers, triton and tvm-ffi for a similar mask cost).

A `GrammarSpec` (trnd/sampling_params.py) is plain data (it travels inside SamplingParams to a prefill server); a
`GrammarState` is one request's matcher. The matcher advances in `Engine.deliver` for every token,
wherever it was sampled, so a prefill server masks and consumes token 0 and the decode server,
whose matcher consumes that same token on arrival, goes on from the state after it.

`after`: a reasoning model thinks first; the grammar starts once the output text contains this
marker (e.g. "</think>"). Text the marker's token carries past it is fed to the matcher.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict

import torch

from trnd.sampling_params import GrammarSpec

log = logging.getLogger("trnd.grammar")

# Compact JSON: the model may not pad a value with unbounded whitespace (a random model would).
JSON_OPTIONS = {"whitespace_flexible": False}
TEMPLATES = 256  # compiled grammars kept (LRU)


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (ValueError when the spec is not even well-formed)."""
    import llguidance as L

    if spec.kind == "json_schema":
        return L.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return L.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return L.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if spec.kind == "lark":
        return L.LLMatcher.grammar_from_lark(spec.value)
    if spec.kind == "ebnf":  # vLLM's `grammar`: GBNF/EBNF or Lark text
        return L.grammar_from("grammar", spec.value)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


class Grammars:
    """The engine's grammar side: the tokenizer as llguidance sees it, and the batched mask."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        import llguidance as L

        self._L = L
        self.vocab_size = vocab_size
        self.tokenizer = L.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self.executor = L.LLExecutor(num_threads=2)
        self._shifts = torch.arange(32, dtype=torch.int32)
        # Compiled matchers by the grammar's canonical text (api/structured.py): a request copies one
        # (deep_copy) instead of compiling again. The same 2 MB grammar sent twice compiled twice, 4-6 s each.
        self._templates: OrderedDict[tuple[str, str], object] = OrderedDict()
        # Why a grammar could not be compiled, by the digest of its text: one a client sends again is refused
        # at once, not compiled again on the one compile thread (a refused 40 KB schema: 0.7-1.5 s each time).
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(spec: GrammarSpec) -> tuple[str, str]:
        return spec.kind, spec.value  # `after` only delays the grammar: the same matcher

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return self._key(spec) in self._templates

    def check(self, spec: GrammarSpec) -> str | None:
        """Why this spec cannot be compiled, or None (and it is kept, compiled, for `state`). Both answers
        are kept: a grammar is compiled once, whether it compiles or not."""
        key = self._key(spec)
        digest = hashlib.blake2b(f"{spec.kind}\0{spec.value}".encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._lock:
            if key in self._templates:
                self._templates.move_to_end(key)
                return None
            if digest in self._refused:
                self._refused.move_to_end(digest)
                return self._refused[digest]
        why = self._compile(spec, key)
        if why is not None:
            with self._lock:
                self._refused[digest] = why
                while len(self._refused) > TEMPLATES:
                    self._refused.popitem(last=False)
        return why

    def _compile(self, spec: GrammarSpec, key: tuple[str, str]) -> str | None:
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError, RecursionError) as e:
            return str(e)
        why = self._L.LLMatcher.validate_grammar(text, self.tokenizer)
        if why:
            return why
        matcher = self._L.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            return matcher.get_error()
        with self._lock:
            self._templates[key] = matcher
            while len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        return None

    def state(self, spec: GrammarSpec) -> "GrammarState":
        with self._lock:
            template = self._templates.get(self._key(spec))
        if template is None:  # evicted since the API checked it (or a prefill server's first sight of it)
            why = self.check(spec)
            if why is not None:
                raise ValueError(f"grammar: {why}")
            with self._lock:
                template = self._templates[self._key(spec)]
        return GrammarState(self, template.deep_copy(), spec.after)

    def mask(self, x: torch.Tensor, rows: list[int], states: list["GrammarState"],
             drafts: list[list[int]] | None = None) -> torch.Tensor:
        """x with every token the grammar forbids at -inf in `rows` (out of place, one batched fill). drafts
        (speculative decoding): state i's drafted tokens, whose rows follow rows[i]; row rows[i] + j + 1 is
        masked as the grammar stands after the first j + 1 of them (llguidance walks them and rolls back).
        Rows past a drafted token the grammar refuses stay unmasked: that token is rejected, they are unused."""
        from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        words = (self.vocab_size + 31) // 32
        if drafts is not None and any(drafts):
            bits = torch.full((x.shape[0], words), -1, dtype=torch.int32)
            fill_next_token_bitmask_par_with_draft_tokens(
                self.executor, [(s.matcher, i, list(d)) for s, i, d in zip(states, rows, drafts)], bits)
            banned = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(x.shape[0], -1)[:, :x.shape[1]] == 0
            return x.masked_fill(banned.to(x.device), float("-inf"))
        bits = torch.empty((len(rows), words), dtype=torch.int32)
        fill_next_token_bitmask_par(self.executor, [(s.matcher, j) for j, s in enumerate(states)], bits)
        banned = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(len(rows), -1)[:, :x.shape[1]] == 0
        if len(rows) < x.shape[0]:  # scatter into a whole-batch mask: one masked_fill either way
            full = torch.zeros(x.shape, dtype=torch.bool)
            full[torch.tensor(rows)] = banned
            banned = full
        return x.masked_fill(banned.to(x.device), float("-inf"))


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, grammars: Grammars, matcher, after: str | None):
        self.grammars = grammars
        self.matcher = matcher
        self.after = after.encode() if after else None
        self._pending = b""  # output bytes while waiting for `after`
        self.failed = False

    @property
    def active(self) -> bool:
        """Masks this step: started (past `after`) and not broken. A finished grammar allows only eos."""
        return self.after is None and not self.failed

    def advance(self, token: int) -> None:
        if self.failed:
            return
        if self.after is not None:
            self._pending += self.grammars.tokenizer.decode_bytes([token])
            at = self._pending.find(self.after)
            if at < 0:
                self._pending = self._pending[-len(self.after):]
                return
            rest, self.after, self._pending = self._pending[at + len(self.after):], None, b""
            if rest and not self.matcher.consume_tokens(self.grammars.tokenizer.tokenize_bytes(rest)):
                self._fail()
            return
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            self._fail()

    def _fail(self) -> None:
        # Only reachable through text the mask did not choose (the `after` token's tail): stop masking.
        self.failed = True
        log.warning("grammar abandoned: %s", self.matcher.get_error())
