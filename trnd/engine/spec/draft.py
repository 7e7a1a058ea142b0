"""A draft model: a smaller checkpoint with the target's tokenizer proposes K tokens, one forward each.

It keeps its own KV: its own pool tensor and page pool (pages counted like the target's, so the same
tokens fit), one `DraftSeq` per request. The draft's KV follows the request: before each proposal it
finds how much of what it fed is still the request's (drafted tokens the target rejected are not) and
feeds the rest in one catch-up chunk: the whole prompt the first time (or after a PD handoff, whose
prompt KV the prefill peer wrote for the target only: the draft prefills it here), one or two tokens
after a verification. A catch-up longer than `chunk` tokens takes several steps, drafting nothing
until it is done. Then K - 1 decode forwards, all requests batched in each.

A greedy request drafts the draft's argmax; a sampling one draws from the draft's distribution under
its own temperature/top-k/top-p/min-p (seeded requests from their seed), and keeps that distribution
for the rejection sampler (engine/spec/verify.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from trnd_kernels.sampling import sample_from_uniform
from trnd.cache.pages import PagePool
from trnd.engine.request import Req
from trnd.engine.runner import ModelRunner, StepInputs
from trnd.engine.sampler import Sampler


@dataclass
class DraftSeq:
    pages: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # tokens whose KV the draft pool holds, by position
    confirmed: int = 0  # fed[:confirmed] is known to be the request's own tokens


class DraftProposer:
    def __init__(self, runner: ModelRunner, num_pages: int, page_size: int, chunk: int, sampler: Sampler):
        self.runner, self.page_size, self.chunk, self.sampler = runner, page_size, chunk, sampler
        self.pool = PagePool(num_pages)
        self.seqs: dict[str, DraftSeq] = {}

    def release(self, rid: str) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is not None and seq.pages:
            self.pool.unref(seq.pages)

    def check_integrity(self) -> None:
        """Every draft page's refcount is the number of sequences holding it (one: drafts share nothing)."""
        self.pool.check_integrity()
        held = Counter(p for s in self.seqs.values() for p in s.pages)
        for p in range(self.pool.num_pages):
            assert self.pool.refcount(p) == held[p], f"draft page {p}: refcount {self.pool.refcount(p)}, {held[p]} holders"

    def propose(self, want: list[tuple[Req, int]]) -> None:
        """Sets draft_ids (and draft_probs for a sampling request) of each request that is caught up and
        whose pages fit; the others draft nothing this step."""
        feeds = []
        for req, k in want:
            seq = self.seqs.setdefault(req.rid, DraftSeq())
            feed = self._sync(seq, req)
            if len(feed) > self.chunk:  # a long catch-up (a prompt) takes several steps; no draft until done
                feed, k = feed[: self.chunk], 0
            if self._grow(seq, len(seq.fed) + len(feed) + max(k - 1, 0)):
                feeds.append((req, seq, feed, k))
        if not feeds:
            return
        logits = self._forward([(seq, feed) for _, seq, feed, _ in feeds])
        live = [(req, seq, k, row) for (req, seq, _, k), row in zip(feeds, logits) if k]
        drafts = {req.rid: ([], []) for req, *_ in live}
        step = 0
        while live:
            picks = [self._pick(req, row, len(req.output_ids) + step) for req, _, _, row in live]
            for (req, *_), (tok, probs) in zip(live, picks):
                drafts[req.rid][0].append(tok)
                drafts[req.rid][1].append(probs)
            step += 1
            more = [(req, seq, k, tok) for (req, seq, k, _), (tok, _) in zip(live, picks) if k > step]
            if not more:
                break
            logits = self._forward([(seq, [tok]) for _, seq, _, tok in more])
            live = [(req, seq, k, row) for (req, seq, k, _), row in zip(more, logits)]
        for req, seq, _, k in feeds:
            if k:
                ids, probs = drafts[req.rid]
                req.draft_ids = ids
                req.draft_probs = None if req.params.greedy else torch.stack(probs)

    def _sync(self, seq: DraftSeq, req: Req) -> list[int]:
        """Drop what the draft fed past the request's own tokens (rejected drafts); the tokens to feed now."""
        valid, total = seq.confirmed, req.num_tokens
        n = min(len(seq.fed), total - 1)  # the request's last token is always fed (its row drafts)
        for fed, own in zip(seq.fed[valid:n], req.ids(valid, n)):
            if fed != own:
                break
            valid += 1
        del seq.fed[valid:]
        seq.confirmed = valid
        return req.ids(valid, total)

    def _grow(self, seq: DraftSeq, tokens: int) -> bool:
        need = -(-tokens // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if not self.pool.can_alloc(need):
            return False
        seq.pages += self.pool.alloc(need)
        return True

    def _forward(self, feeds: list[tuple[DraftSeq, list[int]]]) -> list[torch.Tensor]:
        """One draft forward: each sequence's tokens appended at its next positions (one-token feeds as decode
        rows, longer ones as prefill chunks); the logits of each sequence's last row (all are computed)."""
        p = self.page_size
        ids, pos, page_ids, offsets = [], [], [], []
        decode_pages, decode_ctx, prefill = [], [], []
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i][1]) > 1)  # decode rows first
        last_row = {}
        width = max(len(seq.pages) for seq, _ in feeds)
        for i in order:
            seq, toks = feeds[i]
            start = len(seq.fed)
            q_start = len(ids)
            ids += toks
            pos += range(start, start + len(toks))
            page_ids += [seq.pages[t // p] for t in range(start, start + len(toks))]
            offsets += [t % p for t in range(start, start + len(toks))]
            if len(toks) == 1:
                decode_pages.append(seq.pages + [seq.pages[0]] * (width - len(seq.pages)))
                decode_ctx.append(start + 1)
            else:
                end = start + len(toks)
                prefill.append((q_start, len(toks), end, seq.pages[: -(-end // p)]))
            seq.fed += toks
            last_row[i] = len(ids) - 1
        rows = [last_row[i] for i in range(len(feeds))]
        flat = sorted(rows)
        logits = self.runner.forward(StepInputs(ids, pos, page_ids, offsets, decode_pages, decode_ctx, prefill, flat))
        at = {r: j for j, r in enumerate(flat)}
        return [logits[at[r]] for r in rows]

    def _pick(self, req: Req, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The drafted token at output position `position`, and the distribution it was drawn from."""
        if req.params.greedy:
            return int(self.sampler.argmax(logits[None].float())[0]), None
        y = self.sampler.filtered(logits[None].float(), [req], [0])
        u = self.sampler.uniform(req, position, "draft")
        return int(sample_from_uniform(y, torch.tensor([u]))[0]), torch.softmax(y, dim=-1)[0]

