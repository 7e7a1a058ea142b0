"""ModelRunner: owns the model and the KV pool tensor; turns a scheduled Batch into one forward pass."""

from __future__ import annotations

import torch

from kernels.attention import AttnMeta, PrefillSeq
from trnd.engine.request import Req
from trnd.engine.scheduler import Batch
from trnd.model.config import ModelConfig


def kv_page_bytes(cfg: ModelConfig, num_kv_heads_local: int, page_size: int) -> int:
    """Bytes of one page on one rank: all layers, K and V, this rank's KV heads."""
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    return cfg.num_layers * 2 * num_kv_heads_local * page_size * cfg.head_dim * itemsize


class ModelRunner:
    def __init__(self, model, cfg: ModelConfig, num_pages: int, page_size: int):
        self.model, self.cfg, self.page_size = model, cfg, page_size
        nk = model.layers[0].attn.nk
        # kv[page, layer, k|v, kv_head, slot, head_dim]: see kernels/attention.py for why page-major.
        self.kv = torch.zeros(num_pages, cfg.num_layers, 2, nk, page_size, cfg.head_dim, dtype=cfg.dtype)

    @property
    def page_bytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    def prepare(self, batch: Batch):
        """Flatten the batch: decode tokens first, then each prefill chunk. Returns model inputs and
        the requests whose last row will be sampled (in the order of the logits rows)."""
        p = self.page_size
        ids, pos, page_ids, offsets, sample_rows, sampled = [], [], [], [], [], []
        for req in batch.decode:
            t = req.num_computed
            ids.append(req.all_ids[t])
            pos.append(t)
            page_ids.append(req.pages[t // p])
            offsets.append(t % p)
            sample_rows.append(len(ids) - 1)
            sampled.append(req)
        decode_pages = decode_ctx = None
        if batch.decode:
            width = max(len(r.pages) for r in batch.decode)
            decode_pages = torch.tensor([r.pages + [r.pages[0]] * (width - len(r.pages)) for r in batch.decode])
            decode_ctx = torch.tensor([r.num_computed + 1 for r in batch.decode])
        prefill = []
        for req, n in batch.prefill:
            start, end = req.num_computed, req.num_computed + n
            toks = req.all_ids[start:end]
            q_start = len(ids)
            ids += toks
            pos += range(start, end)
            page_ids += [req.pages[t // p] for t in range(start, end)]
            offsets += [t % p for t in range(start, end)]
            prefill.append(PrefillSeq(q_start, n, end, torch.tensor(req.pages[: -(-end // p)])))
            if end == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(req)
        meta = AttnMeta(torch.tensor(page_ids), torch.tensor(offsets), len(batch.decode), decode_pages,
                        decode_ctx, prefill)
        return torch.tensor(ids), torch.tensor(pos), meta, torch.tensor(sample_rows, dtype=torch.long), sampled

    def run(self, batch: Batch) -> tuple[torch.Tensor, list[Req]]:
        ids, pos, meta, rows, sampled = self.prepare(batch)
        logits = self.model(ids, pos, self.kv, meta, rows)
        return logits, sampled
