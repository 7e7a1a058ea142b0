"""Offline entry point: `LLM(model_dir).generate(prompts, params)` runs the servers' engine loop in-process."""

from __future__ import annotations

from dataclasses import dataclass, field

from trnd.engine.build import EngineConfig, build
from trnd.engine.engine import Engine
from trnd.engine.output import TokenLogprob
from trnd.model.maker import resolve_model
from trnd.sampling_params import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLM:
    def __init__(self, model: str | None = None, revision: str | None = None, **engine_args):
        """model: a directory, a Hugging Face id in the local cache, or a preset name (tiny, small), as
        `trnd serve --model` takes it."""
        self.engine = Engine(build(EngineConfig(model=str(resolve_model(model, revision)), **engine_args)))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, plist, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req = self.engine.add(ids, p)
            results[req.rid] = Completion(ids)
            order.append(req.rid)
        pending = set(order)
        while pending:
            for out in self.engine.step():
                c = results[out.rid]
                c.token_ids += out.token_ids
                c.text += out.text
                c.logprobs += out.logprobs or []
                if out.finished:
                    c.finish_reason, c.cached_tokens = out.finish_reason, out.cached_tokens
                    pending.discard(out.rid)
        return [results[r] for r in order]
