"""ModelRunner: owns this rank's model shard and KV pool tensor; turns a Batch into one forward pass.

`prepare` flattens a Batch into `StepInputs`, plain ints in a msgspec Struct: rank 0 builds them and,
under tensor parallelism, broadcasts the encoded bytes to the other ranks (engine/workers.py), which
run the same `forward`.
"""

from __future__ import annotations

import msgspec
import torch

from trnd_kernels import fp8
from trnd_kernels.attention import AttnMeta, PrefillSeq
from trnd.engine.request import Req
from trnd.engine.scheduler import Batch
from trnd.model.config import ModelConfig
from trnd.transfer.plan import Layout


class StepInputs(msgspec.Struct, array_like=True):
    ids: list[int]
    positions: list[int]
    page_ids: list[int]  # per token: the page its KV goes to
    offsets: list[int]  # per token: the slot in that page
    decode_pages: list[list[int]]  # per decode row: its sequence's page table, padded
    decode_ctx: list[int]  # per decode row: context length including its token
    prefill: list[tuple[int, int, int, list[int]]]  # (q_start, q_len, ctx_len, pages)
    sample_rows: list[int]  # rows of the batch whose logits are wanted


def kv_page_bytes(cfg: ModelConfig, num_kv_heads_local: int, page_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one page on one rank: all layers, every part of the pool kind (K and V; MLA's one latent part),
    this rank's heads (fp8: with their scales)."""
    pool = cfg.pool
    itemsize, scale_bytes = fp8.block_bytes(fp8.kv_dtype(kv_cache_dtype, cfg.dtype), page_size, pool.width)
    return cfg.num_layers * pool.parts * num_kv_heads_local * (page_size * pool.width * itemsize + scale_bytes)


def pool_layout(cfg: ModelConfig, page_size: int, pool_dtype: torch.dtype, rank_heads) -> Layout:
    """The transfer layout (transfer/plan.py) of the pages alloc_kv makes: the pool kind's parts and row width,
    each rank's [start, end) heads, fp8 blocks with their scales."""
    pool = cfg.pool
    itemsize, scale_bytes = fp8.block_bytes(pool_dtype, page_size, pool.width)
    return Layout(cfg.num_layers, page_size, pool.width, itemsize, tuple(rank_heads), scale_bytes, pool.parts,
                  pool.name)


def prepare(batch: Batch, page_size: int) -> tuple[StepInputs, list[Req]]:
    """Flatten the batch: decode tokens first, then each prefill chunk. Also returns the requests
    whose last row is sampled, in the order of the logits rows (a decode request with drafted tokens has
    1 + len(draft_ids) rows: engine/sampler.py verify)."""
    p = page_size
    ids, pos, page_ids, offsets, rows, sampled = [], [], [], [], [], []
    decode_ctx, tables = [], []
    for req in batch.decode:
        # The last token, then each drafted token (speculative decoding): one decode row each, row j attending
        # the context up to its own position, so K drafts are verified in this one forward.
        t = req.num_computed
        for j, token in enumerate((*req.ids(t, t + 1), *req.draft_ids)):
            ids.append(token)
            pos.append(t + j)
            page_ids.append(req.pages[(t + j) // p])
            offsets.append((t + j) % p)
            rows.append(len(ids) - 1)
            decode_ctx.append(t + j + 1)
            tables.append(req.pages)
        sampled.append(req)
    width = max((len(pages) for pages in tables), default=0)
    decode_pages = [pages + [pages[0]] * (width - len(pages)) for pages in tables]
    prefill = []
    for req, n in batch.prefill:
        start, end = req.num_computed, req.num_computed + n
        q_start = len(ids)
        ids += req.ids(start, end)
        pos += range(start, end)
        page_ids += [req.pages[t // p] for t in range(start, end)]
        offsets += [t % p for t in range(start, end)]
        prefill.append((q_start, n, end, req.pages[: -(-end // p)]))
        if end == req.num_tokens:
            rows.append(len(ids) - 1)
            sampled.append(req)
    return StepInputs(ids, pos, page_ids, offsets, decode_pages, decode_ctx, prefill, rows), sampled


def alloc_kv(cfg: ModelConfig, num_kv_heads_local: int, num_pages: int, page_size: int,
             shared: bool = False, device: str = "cpu", kv_cache_dtype: str = "auto") -> torch.Tensor:
    """kv[page, layer, k|v, kv_head, slot, head_dim]: see kernels/attention.py for why page-major; an fp8
    pool is kv[page, layer, k|v, kv_head, slot * head_dim + 4] (each block's values, then its scale:
    kernels/fp8.py). Generally kv[page, layer, part, head, slot, width] of the model's pool kind
    (model/config.py PoolKind): MLA's latent pool is kv[page, layer, 1, 1, slot, kv_lora_rank + qk_rope_head_dim].
    shared: in shared memory, so the role process can map every rank's pool (one NIXL agent per role
    registers them all, and the host tier copies pages out of any rank); host memory only.
    device: the backend's device. The pool is made there, never moved: the host tier and the transfers
    hold this very tensor."""
    if shared and device != "cpu":
        raise ValueError(f"a shared-memory KV pool lives in host memory, not on {device!r}")
    dtype = fp8.kv_dtype(kv_cache_dtype, cfg.dtype)
    pool = cfg.pool
    block = (page_size * pool.width + fp8.SCALE_BYTES,) if fp8.is_fp8(torch.empty(0, dtype=dtype)) else \
        (page_size, pool.width)
    kv = torch.zeros(num_pages, cfg.num_layers, pool.parts, num_kv_heads_local, *block, dtype=dtype, device=device)
    return kv.share_memory_() if shared else kv


class ModelRunner:
    """The model runs where its KV pool is (alloc_kv puts it on the backend's device): the weights are
    moved there once, and each step's inputs are built there."""

    def __init__(self, model, cfg: ModelConfig, kv: torch.Tensor):
        self.model, self.cfg, self.kv = model.to(kv.device), cfg, kv
        self.device = kv.device
        self.page_size = fp8.page_size_of(kv, cfg.pool.width)
        self.num_kv_heads = model.layers[0].attn.nk  # this rank's
        self.compiled = None  # engine/compiled.py CompiledDecode: takes the decode-only steps when set
        assert kv.shape[3] == self.num_kv_heads, (kv.shape, self.num_kv_heads)

    @property
    def page_bytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    @property
    def kv_dtype(self) -> str:
        return str(self.kv.dtype).removeprefix("torch.")

    def tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def forward(self, x: StepInputs) -> torch.Tensor:
        t = self.tensor
        if self.compiled is not None and x.decode_ctx and not x.prefill:  # every row a decode, every one sampled
            return self.compiled(t(x.ids), t(x.positions), t(x.page_ids), t(x.offsets), t(x.decode_pages),
                                 t(x.decode_ctx), self.kv)
        meta = AttnMeta(t(x.page_ids), t(x.offsets), len(x.decode_ctx),
                        t(x.decode_pages) if x.decode_ctx else None, t(x.decode_ctx) if x.decode_ctx else None,
                        [PrefillSeq(a, b, c, t(pages)) for a, b, c, pages in x.prefill])
        return self.model(t(x.ids), t(x.positions), self.kv, meta, t(x.sample_rows))
