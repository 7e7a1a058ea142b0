"""Turns one row of logits per request into its next token (plus logprobs when asked).

Pipeline per row: logit_bias -> penalties -> min_tokens ban -> grammar mask -> [logprobs read here] -> greedy argmax, or
temperature -> top_k/top_p/min_p -> inverse-CDF draw with one uniform u per row.

Logprobs are "processed" logprobs in one fixed sense: log_softmax of the logits AFTER repetition/
frequency/presence penalties and the min_tokens ban, BEFORE temperature and top-k/top-p/min-p.
So they do not change with temperature, and a banned token (eos under min_tokens) reads -inf.

Seeded draws: the uniform for output position i is a pure function of (seed, i) (`seed_uniform`),
and the token a pure function of (filtered probabilities, u) (`kernels.sampling.sample_from_uniform`).
So a seeded request yields the same tokens alone or batched, and when consecutive positions are
sampled by different processes (prefill server samples token 0, decode server the rest), as far as
the logits themselves are reproducible (batch-variant matmuls can still move a near-tie).

Grammar rows (engine/grammar.py) are masked in one batched fill; rows without a grammar cost nothing,
and a batch with none keeps the plain-greedy fast path. The min_tokens ban skips grammar rows: a
finished grammar allows only eos, which the ban would leave no token at all.

`ignore_eos` masks nothing here: the engine simply does not stop on eos. `min_tokens` does mask:
while len(output_ids) < min_tokens, the eos ids and stop_token_ids get -inf.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trnd_kernels import sampling as K
from trnd.engine.request import Req, SamplingParams


@dataclass(slots=True)
class SampleOut:
    token: int
    logprob: float | None = None  # set iff params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None = None  # params.logprobs entries, descending


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _min_tokens_active(r: Req) -> bool:
    return len(r.output_ids) < r.params.min_tokens and not _masked(r)


def _masked(r: Req) -> bool:
    return r.grammar is not None and r.grammar.active


def _plain_greedy(r: Req) -> bool:
    p = r.params
    return (p.greedy and p.logprobs is None and not _has_penalty(p) and not _min_tokens_active(r)
            and r.grammar is None and not p.logit_bias)


def seed_uniform(seed: int, position: int) -> float:
    """The draw for output position `position` of a request seeded with `seed`: u in (0, 1).
    blake2b, not hash(): stable across processes and machines, defined for any int, ~1 us."""
    v = int.from_bytes(hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest(), "little")
    return _uniform(v >> 11)


def _uniform(bits53: int) -> float:
    return (bits53 + 0.5) / (1 << 53)  # never 0: u = 0 would land on token 0 even when it is masked


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int | None = None, argmax: Callable = K.argmax):
        """seed: only for the draws of unseeded requests (tests); None takes OS entropy. argmax: the rows' argmax
        op, the model's (kernels.Ops.argmax: compiled on the CPU)."""
        self.eos_token_ids = list(eos_token_ids)
        self._rng = random.Random(seed)
        self.argmax = argmax

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[SampleOut]:
        B, V = logits.shape
        if B != len(reqs):
            raise ValueError(f"logits has {B} rows for {len(reqs)} requests")
        if all(_plain_greedy(r) for r in reqs):  # decode hot path: one batched argmax
            return [SampleOut(t) for t in self.argmax(logits).tolist()]

        dev = logits.device
        x = logits.float()
        bias = [(i, t, b) for i, r in enumerate(reqs) if r.params.logit_bias
                for t, b in r.params.logit_bias.items() if 0 <= t < V]
        if bias:
            rows, cols, vals = zip(*bias)
            x = x.index_put((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                            torch.tensor(vals, dtype=torch.float32, device=dev), accumulate=True)
        pen = [i for i, r in enumerate(reqs) if _has_penalty(r.params)]
        if pen:
            sub = [reqs[i] for i in pen]
            rows = torch.tensor(pen, device=dev)
            penalized = K.apply_penalties(
                x[rows],
                K.token_counts([r.prompt_ids for r in sub], V, dev) > 0,
                K.token_counts([r.output_ids for r in sub], V, dev),
                torch.tensor([r.params.presence_penalty for r in sub], dtype=torch.float32, device=dev),
                torch.tensor([r.params.frequency_penalty for r in sub], dtype=torch.float32, device=dev),
                torch.tensor([r.params.repetition_penalty for r in sub], dtype=torch.float32, device=dev))
            x = x.index_put((rows,), penalized)  # out of place: never write into the caller's logits

        ban_rows, ban_cols = [], []
        for i, r in enumerate(reqs):
            if _min_tokens_active(r):
                ids = {t for t in (*self.eos_token_ids, *r.params.stop_token_ids) if 0 <= t < V}
                ban_rows += [i] * len(ids)
                ban_cols += ids
        if ban_rows:
            x = x.index_put((torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)),
                            torch.tensor(float("-inf"), device=dev))

        gram = [i for i, r in enumerate(reqs) if _masked(r)]
        if gram:
            states = [reqs[i].grammar for i in gram]
            x = states[0].grammars.mask(x, gram, states)

        tokens = self.argmax(x)  # right for greedy rows; random rows are overwritten below
        rnd = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rnd:
            ps = [reqs[i].params for i in rnd]
            rows = torch.tensor(rnd, device=dev)
            y = K.apply_temperature(x[rows], torch.tensor([p.temperature for p in ps], device=dev))
            y = K.top_k_top_p_min_p_mask(
                y,
                torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev),
                torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev),
                torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev))
            u = [seed_uniform(p.seed, len(reqs[i].output_ids)) if p.seed is not None
                 else _uniform(self._rng.getrandbits(53)) for i, p in zip(rnd, ps)]
            drawn = K.sample_from_uniform(y, torch.tensor(u, dtype=torch.float32, device=dev))
            tokens = tokens.index_put((rows,), drawn)

        outs = [SampleOut(t) for t in tokens.tolist()]
        lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp:
            rows = torch.tensor(lp, device=dev)
            logprobs = K.log_softmax(x[rows])
            chosen = logprobs.gather(1, tokens[rows, None])[:, 0].tolist()
            kmax = min(max(reqs[i].params.logprobs for i in lp), V)
            top_v, top_i = K.topk_logprobs(logprobs, kmax)
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(lp):
                k = reqs[i].params.logprobs
                outs[i].logprob = chosen[j]
                outs[i].top_logprobs = list(zip(top_i[j][:k], top_v[j][:k]))
        return outs
