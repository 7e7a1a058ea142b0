"""Per-request output side: incremental detokenization, stop strings, and the StepOutput deltas the
servers stream. Kept out of Req so the scheduler's record stays free of text concerns."""

from __future__ import annotations

import msgspec

from trnd.engine.request import Req
from trnd.engine.sampler import SampleOut
from trnd.engine.stops import StopChecker
from trnd.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TokenLogprob(msgspec.Struct, array_like=True):
    token: int
    logprob: float
    top: list[tuple[int, float]]


class StepOutput(msgspec.Struct):
    """What one request produced since the last StepOutput for it."""
    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_from: dict[str, int] | None = None  # cached_tokens by source (Req.cached_from), on the last one


class OutputStream:
    def __init__(self, tokenizer: Tokenizer, req: Req):
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, req.params.skip_special_tokens)
        self.stops = StopChecker(req.params.stop, req.params.include_stop_str_in_output)
        self.want_logprobs = req.params.logprobs is not None
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []

    def push(self, s: SampleOut) -> bool:
        """Record one sampled token; True when a stop string completed."""
        self._tokens.append(s.token)
        if self.want_logprobs:
            self._logprobs.append(TokenLogprob(s.token, s.logprob, list(s.top_logprobs or [])))
        text, stopped = self.stops.push(self.detok.push(s.token))
        self._text.append(text)
        return stopped

    def take(self, req: Req, finished: bool = False) -> StepOutput:
        out = StepOutput(req.rid, self._tokens, "".join(self._text), self._logprobs if self.want_logprobs else None,
                         finished, req.finish_reason if finished else None, req.num_prompt, req.num_output,
                         req.cached_tokens, dict(req.cached_from) if finished else None)
        self._tokens, self._text, self._logprobs = [], [], []
        return out

    def finish(self, req: Req) -> StepOutput:
        if not self.stops.stopped:  # release what the detokenizer and the stop checker held back
            tail, stopped = self.stops.push(self.detok.flush())
            self._text.append(tail)
            if not stopped:
                self._text.append(self.stops.flush())
        return self.take(req, finished=True)
