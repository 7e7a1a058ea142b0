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
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trnd_kernels import sampling as K
from trnd.engine.request import Req, SamplingParams
from trnd.engine.spec.verify import accept_greedy, rejection_sample


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


def seed_uniform(seed: int, position: int, salt: str = "") -> float:
    """The draw for output position `position` of a request seeded with `seed`: u in (0, 1); `salt` names
    another stream of draws (speculative decoding's acceptance tests). blake2b, not hash(): stable across
    processes and machines, defined for any int, ~1 us."""
    v = int.from_bytes(hashlib.blake2b(f"{seed}:{position}{salt}".encode(), digest_size=8).digest(), "little")
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
        x = self._process(logits, reqs, [0] * B)
        tokens = self.argmax(x)  # right for greedy rows; random rows are overwritten below
        rnd = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rnd:
            y = self.filtered(x, [reqs[i] for i in rnd], rnd)
            u = [self.uniform(reqs[i], len(reqs[i].output_ids)) for i in rnd]
            drawn = K.sample_from_uniform(y, torch.tensor(u, dtype=torch.float32, device=x.device))
            tokens = tokens.index_put((torch.tensor(rnd, device=x.device),), drawn)
        outs = [SampleOut(t) for t in tokens.tolist()]
        self._logprobs(x, reqs, list(range(B)), outs)
        return outs

    def verify(self, logits: torch.Tensor, reqs: list[Req]) -> list[list[SampleOut]]:
        """Speculative decoding: each request has 1 + len(req.draft_ids) consecutive rows (its last token's, then
        each drafted token's); row j is sampled as the target would after output_ids + draft_ids[:j]. Returns
        the tokens each request emits, in order: the drafts kept, then one of the target's own (engine/spec/
        verify.py: greedy acceptance, rejection sampling for temperature > 0)."""
        row_req = [r for r in reqs for _ in range(1 + len(r.draft_ids))]
        ahead = [j for r in reqs for j in range(1 + len(r.draft_ids))]
        if logits.shape[0] != len(row_req):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(row_req)} drafted rows")
        firsts = list(itertools.accumulate((1 + len(r.draft_ids) for r in reqs), initial=0))
        if all(_plain_greedy(r) for r in reqs):
            target = self.argmax(logits).tolist()
            return [[SampleOut(t) for t in accept_greedy(r.draft_ids, target[f: f + 1 + len(r.draft_ids)])]
                    for r, f in zip(reqs, firsts)]
        x = self._process(logits, row_req, ahead)
        target = self.argmax(x).tolist()
        rnd = [i for i, r in enumerate(row_req) if not r.params.greedy]
        probs = {}
        if rnd:
            y = self.filtered(x, [row_req[i] for i in rnd], rnd)
            probs = dict(zip(rnd, torch.softmax(y, dim=-1)))
        emitted: list[list[int]] = []
        for r, f in zip(reqs, firsts):
            k = len(r.draft_ids)
            if r.params.greedy:
                emitted.append(accept_greedy(r.draft_ids, target[f: f + k + 1]))
                continue
            p = torch.stack([probs[f + j] for j in range(k + 1)])
            at = len(r.output_ids)
            emitted.append(rejection_sample(p, r.draft_ids, r.draft_probs,
                                            [self.uniform(r, at + j, "accept") for j in range(k)],
                                            [self.uniform(r, at + j) for j in range(k + 1)]))
        outs, rows = [], []
        for r, f, toks in zip(reqs, firsts, emitted):
            outs.append([SampleOut(t) for t in toks])
            rows += range(f, f + len(toks))
        flat = [o for per in outs for o in per]
        self._logprobs(x, [row_req[i] for i in rows], rows, flat)
        return outs

    def uniform(self, r: Req, position: int, salt: str = "") -> float:
        seed = r.params.seed
        return seed_uniform(seed, position, salt) if seed is not None else _uniform(self._rng.getrandbits(53))

    def _process(self, logits: torch.Tensor, reqs: list[Req], ahead: list[int]) -> torch.Tensor:
        """fp32 logits after logit_bias, penalties, the min_tokens ban and the grammar mask; row i as request
        reqs[i] would see it after its output and the first ahead[i] of its drafted tokens."""
        B, V = logits.shape
        dev = logits.device
        x = logits.float()
        seen = [r.output_ids + r.draft_ids[:a] if a else r.output_ids for r, a in zip(reqs, ahead)]
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
                K.token_counts([seen[i] for i in pen], V, dev),
                torch.tensor([r.params.presence_penalty for r in sub], dtype=torch.float32, device=dev),
                torch.tensor([r.params.frequency_penalty for r in sub], dtype=torch.float32, device=dev),
                torch.tensor([r.params.repetition_penalty for r in sub], dtype=torch.float32, device=dev))
            x = x.index_put((rows,), penalized)  # out of place: never write into the caller's logits

        ban_rows, ban_cols = [], []
        for i, r in enumerate(reqs):
            if len(seen[i]) < r.params.min_tokens and not _masked(r):
                ids = {t for t in (*self.eos_token_ids, *r.params.stop_token_ids) if 0 <= t < V}
                ban_rows += [i] * len(ids)
                ban_cols += ids
        if ban_rows:
            x = x.index_put((torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)),
                            torch.tensor(float("-inf"), device=dev))

        gram = [i for i, r in enumerate(reqs) if _masked(r) and ahead[i] == 0]
        if gram:
            states = [reqs[i].grammar for i in gram]
            # a request's drafted rows follow its first row: the matcher walks its drafts (engine/grammar.py)
            drafts = [reqs[i].draft_ids if i + 1 < B and ahead[i + 1] == 1 and reqs[i + 1] is reqs[i] else []
                      for i in gram]
            x = states[0].grammars.mask(x, gram, states, drafts)
        return x

    @staticmethod
    def filtered(x: torch.Tensor, reqs: list[Req], rows: list[int]) -> torch.Tensor:
        """The rows' logits after temperature and top-k/top-p/min-p: what a random row draws from."""
        dev = x.device
        ps = [r.params for r in reqs]
        y = K.apply_temperature(x[torch.tensor(rows, device=dev)],
                                torch.tensor([p.temperature for p in ps], device=dev))
        return K.top_k_top_p_min_p_mask(
            y,
            torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev),
            torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev),
            torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev))

    @staticmethod
    def _logprobs(x: torch.Tensor, reqs: list[Req], rows: list[int], outs: list[SampleOut]) -> None:
        """outs[i] (the token drawn at row rows[i] for reqs[i]) gets its logprob and top logprobs where asked."""
        lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not lp:
            return
        dev = x.device
        logprobs = K.log_softmax(x[torch.tensor([rows[i] for i in lp], device=dev)])
        chosen = logprobs.gather(1, torch.tensor([[outs[i].token] for i in lp], device=dev))[:, 0].tolist()
        kmax = min(max(reqs[i].params.logprobs for i in lp), x.shape[1])
        top_v, top_i = K.topk_logprobs(logprobs, kmax)
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(lp):
            k = reqs[i].params.logprobs
            outs[i].logprob = chosen[j]
            outs[i].top_logprobs = list(zip(top_i[j][:k], top_v[j][:k]))
